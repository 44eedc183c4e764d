"""``refengine bench``: every benchmark of refengine, in-process scenarios, the HTTP client
and the single-purpose studies (``refengine bench COMMAND --help`` lists each one's flags).

In-process scenarios, closed loop over ``LLMEngine``:

- ``throughput``: N requests with seeded random prompt and output lengths, all submitted
  at once (vLLM's ``benchmark_throughput``). Requests/s, output tokens/s, total tokens/s.
- ``chat``: short prompts and answers at a fixed concurrency. P50/P90/P99 TTFT and TPOT.
- ``generation``: short prompts, long outputs. Throughput (decode-bound).
- ``long-context``: long prompts, short outputs, run twice, with chunked prefill on and
  off. TTFT and inter-token latency (prefill-bound).
- ``sweep``: one workload at concurrency 1, 2, 4, ... N. Output tokens/s, TTFT and TPOT
  against concurrency, and the knee: the concurrency past which throughput stops growing
  (< ``--min-gain``) while latency climbs.
- ``forward``: one forward pass per row count against the machine's roofline.

The others: ``serve`` (an OpenAI-compatible server loaded over HTTP), ``spec`` (n-gram
speculation off and on), ``prefix-cache`` (caching off and on), ``kernels`` (the numba
kernels against their NumPy twins and BLAS), ``import-order`` (one workload in fresh
processes that imported NumPy or torch first).

One concern per module:

- ``workload.py``: the prompt corpus, ``BenchRequest``, seeded request lengths;
- ``driver.py``: ``run_engine`` (closed loop over ``LLMEngine``), ``RunResult``, latency summaries;
- ``hf_baseline.py``: the same requests through ``transformers`` ``generate``, and the ratios;
- ``sweep.py``: concurrency levels and the knee;
- ``machine.py``: the CPU, the commit, and the measured bandwidth and FLOP/s;
- ``report.py``: text and Markdown tables, the JSON report, the environment, the
  busy-machine warning, the sections of ``docs/PERFORMANCE.md`` (``write_performance``);
- ``plot.py``: PNG plots;
- ``scenarios.py``: each in-process scenario from engine build to report;
- ``forward.py``, ``breakdown.py``: one pass against the roofline; where a step's time goes;
- ``serve.py``, ``spec.py``, ``prefix_cache.py``, ``kernels.py``, ``import_order.py``: one
  command each;
- ``options.py``: the flags the commands share (``--performance-md`` among them);
- ``cli.py``: the ``bench`` click group.
"""

from refengine.bench.cli import bench

__all__ = ["bench"]
