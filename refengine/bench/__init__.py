"""``refengine bench``: throughput and latency benchmarks, side by side with ``transformers``.

Scenarios (``refengine bench SCENARIO --help`` lists each one's flags and defaults):

- ``throughput``: N requests with seeded random prompt and output lengths, all submitted
  at once (vLLM's ``benchmark_throughput``). Requests/s, output tokens/s, total tokens/s.
- ``chat``: short prompts and answers at a fixed concurrency. P50/P90/P99 TTFT and TPOT.
- ``generation``: short prompts, long outputs. Throughput (decode-bound).
- ``long-context``: long prompts, short outputs, run twice, with chunked prefill on and
  off. TTFT and inter-token latency (prefill-bound).
- ``sweep``: one workload at concurrency 1, 2, 4, ... N. Output tokens/s, TTFT and TPOT
  against concurrency, and the knee: the concurrency past which throughput stops growing
  (< ``--min-gain``) while latency climbs.

One concern per module:

- ``workload.py``: the prompt corpus, ``BenchRequest``, seeded request lengths;
- ``driver.py``: ``run_engine`` (closed loop over ``LLMEngine``), ``RunResult``, latency summaries;
- ``hf_baseline.py``: the same requests through ``transformers`` ``generate``, and the ratios;
- ``sweep.py``: concurrency levels and the knee;
- ``report.py``: text tables, the JSON report, the environment, the busy-machine warning;
- ``plot.py``: PNG plots;
- ``scenarios.py``: each scenario from engine build to report;
- ``cli.py``: the ``bench`` click group.
"""

from refengine.bench.cli import bench

__all__ = ["bench"]
