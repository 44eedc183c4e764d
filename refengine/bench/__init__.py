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

How requests are driven. The bench drives ``LLMEngine`` directly (``add_request`` /
``step``), closed loop: it keeps at most ``--max-concurrency`` requests in flight and
adds the next one as soon as one finishes; with no limit every request is added before
the first step (offline batch, as ``LLM.generate`` does). A request's TTFT is measured
from its ``add_request``. The engine is built once per scenario with ``max_num_seqs`` at
least the concurrency, so concurrency is set by the client, not by engine settings.

Prompts are token windows cut from real text (``benchmarks/data/*.txt``, see its README):
the text is tokenized once, then each request takes a seeded random window of the
requested length. Requests use ``SamplingParams(temperature=0, ignore_eos=True,
max_tokens=output_len)`` so every request produces exactly ``output_len`` tokens.

``--compare-transformers`` runs the same token ids through ``transformers``
(``AutoModelForCausalLM``, ``--hf-dtype`` float32 by default, on ``--device``, ``generate`` with greedy decoding and left padding)
in batches of ``--hf-batch-size`` requests, the way a user would batch it by hand: each
batch runs to its longest output (``min_new_tokens = max_new_tokens`` so EOS cannot end
it early). Only the requested tokens count toward its throughput. Per-token times come
from a logits processor that stamps each generation step; all requests of a batch arrive
when the batch starts and finish when ``generate`` returns.

Units: times in seconds in per-request records, milliseconds in summaries (keys end in
``_ms``); throughputs in requests/s or tokens/s.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import math
import os
import pathlib
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import click
import numpy as np

from refengine.metrics import RequestMetrics, StepRecord, percentile

DEFAULT_MODEL = "weights/SmolLM2-135M-Instruct"
DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "data"
PERCENTILES = (50, 90, 99)


def default_model_dir() -> str:
    """``$REFENGINE_MODEL`` if set, else ``weights/SmolLM2-135M-Instruct``."""
    return os.environ.get("REFENGINE_MODEL", DEFAULT_MODEL)


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int


def parse_len_range(value: str | int | tuple[int, int]) -> tuple[int, int]:
    """Parse a length flag: ``"128"`` means exactly 128, ``"16-512"`` uniform in [16, 512].

    Raises:
        ValueError: not an int or ``LO-HI`` with ``1 <= LO <= HI`` (0 allowed for outputs is
            not useful for a benchmark, so lengths start at 1).
    """
    if isinstance(value, tuple):
        lo, hi = value
    elif isinstance(value, int):
        lo = hi = value
    else:
        text = value.strip()
        try:
            if "-" in text:
                a, b = text.split("-", 1)
                lo, hi = int(a), int(b)
            else:
                lo = hi = int(text)
        except ValueError:
            raise ValueError(f"length {value!r} is not N or LO-HI (e.g. 128 or 16-512)") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"length range {lo}-{hi} is invalid: need 1 <= LO <= HI")
    return lo, hi


def load_corpus(data_dir: str | os.PathLike | None = None) -> str:
    """All ``*.txt`` files of ``data_dir`` (default ``benchmarks/data``), sorted by name, joined.

    Raises:
        FileNotFoundError: no ``.txt`` file there.
    """
    d = pathlib.Path(data_dir) if data_dir is not None else DATA_DIR
    files = sorted(d.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {d} to cut benchmark prompts from")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def sample_requests(corpus_token_ids: Sequence[int], num_prompts: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], seed: int, prefix: str = "req") -> list[BenchRequest]:
    """Seeded requests whose prompts are windows of the tokenized corpus.

    Each request draws its prompt length uniformly from ``input_len`` (inclusive), its
    output length from ``output_len``, and a start offset in the corpus; the window wraps
    around the end of the corpus, so any length works with any corpus.

    Raises:
        ValueError: empty corpus or ``num_prompts < 1``.
    """
    if len(corpus_token_ids) == 0:
        raise ValueError("the corpus tokenized to no tokens")
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = np.random.default_rng(seed)
    ids = np.asarray(corpus_token_ids, dtype=np.int64)
    out = []
    for i in range(num_prompts):
        n_in = int(rng.integers(input_len[0], input_len[1] + 1))
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        start = int(rng.integers(0, len(ids)))
        window = np.take(ids, np.arange(start, start + n_in), mode="wrap")
        out.append(BenchRequest(f"{prefix}-{i}", window.tolist(), n_out))
    return out


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one request did, in seconds and token counts."""

    request_id: str
    prompt_len: int
    output_len: int  # tokens actually produced
    expected_output_len: int
    ttft: float | None
    tpot: float | None
    e2e_latency: float | None
    queue_time: float | None
    inter_token_latencies: list[float]
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, req: BenchRequest, m: RequestMetrics, output_token_ids: list[int]) -> RequestResult:
        return cls(request_id=req.request_id, prompt_len=len(req.prompt_token_ids),
                   output_len=m.num_output_tokens, expected_output_len=req.output_len,
                   ttft=m.ttft, tpot=m.tpot, e2e_latency=m.e2e_latency, queue_time=m.queue_time,
                   inter_token_latencies=m.inter_token_latencies, output_token_ids=list(output_token_ids))


def latency_summary(values_s: Iterable[float | None]) -> dict:
    """Mean, median, P90, P99, min, max of latencies given in seconds, reported in milliseconds.

    Missing values (None) are skipped; every figure is None when nothing is left.
    """
    xs = [v for v in values_s if v is not None]
    keys = ["mean_ms", "median_ms"] + [f"p{p}_ms" for p in PERCENTILES] + ["min_ms", "max_ms"]
    if not xs:
        return dict.fromkeys(keys)
    ms = [1000.0 * v for v in xs]
    out = {"mean_ms": sum(ms) / len(ms), "median_ms": percentile(ms, 50)}
    out.update({f"p{p}_ms": percentile(ms, p) for p in PERCENTILES})
    out.update({"min_ms": min(ms), "max_ms": max(ms)})
    return out


@dataclass
class RunResult:
    """One pass of a workload through one engine (refengine or transformers).

    Attributes:
        label: e.g. ``"refengine"``, ``"refengine chunked=off"``, ``"transformers"``.
        max_concurrency: most requests in flight (None: all at once).
        elapsed_s: wall time from the first request submitted to the last finished, seconds.
        requests: per-request results, in workload order.
        steps: the engine steps taken during the run (empty for transformers).
    """

    label: str
    max_concurrency: int | None
    elapsed_s: float
    requests: list[RequestResult]
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def _per_s(self, amount: float) -> float:
        return amount / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def request_throughput(self) -> float:
        """Requests per second."""
        return self._per_s(self.num_requests)

    @property
    def output_throughput(self) -> float:
        """Output tokens per second."""
        return self._per_s(self.total_output_tokens)

    @property
    def total_token_throughput(self) -> float:
        """Prompt plus output tokens per second."""
        return self._per_s(self.total_prompt_tokens + self.total_output_tokens)

    def latencies(self) -> dict[str, dict]:
        """``ttft``, ``tpot``, ``itl`` (every inter-token gap of every request), ``e2e``, ``queue``: summaries in ms."""
        return {
            "ttft": latency_summary(r.ttft for r in self.requests),
            "tpot": latency_summary(r.tpot for r in self.requests),
            "itl": latency_summary(x for r in self.requests for x in r.inter_token_latencies),
            "e2e": latency_summary(r.e2e_latency for r in self.requests),
            "queue": latency_summary(r.queue_time for r in self.requests),
        }

    def summary(self) -> dict:
        """The run's headline figures (throughputs, token totals, latency summaries)."""
        short = [r.request_id for r in self.requests if r.output_len != r.expected_output_len]
        return {
            "label": self.label,
            "max_concurrency": self.max_concurrency,
            "num_requests": self.num_requests,
            "elapsed_s": self.elapsed_s,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "num_steps": len(self.steps),
            "requests_with_unexpected_output_len": short,
            "latency": self.latencies(),
        }

    def to_dict(self) -> dict:
        """Summary plus every per-request record and every step record (JSON-ready)."""
        return {
            **self.summary(),
            "requests": [dataclasses.asdict(r) for r in self.requests],
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }


# ---------------------------------------------------------------------------------------
# Driving the engine
# ---------------------------------------------------------------------------------------


def run_engine(engine, requests: Sequence[BenchRequest], *, max_concurrency: int | None = None,
               label: str = "refengine", progress: bool = True, sampling_params_factory=None) -> RunResult:
    """Run ``requests`` through an ``LLMEngine``, closed loop, at most ``max_concurrency`` in flight.

    Args:
        engine: anything with ``add_request(request_id, prompt_token_ids, sampling_params)``,
            ``step() -> list[RequestOutput]``, ``has_unfinished_requests()`` and
            ``.metrics`` (an :class:`~refengine.metrics.EngineMetrics`, for the step records).
        requests: the workload; request ids must be unique within the engine.
        max_concurrency: most requests in flight; None adds them all before the first step.
        label: names the run in tables and plots.
        progress: show a tqdm bar of finished requests.
        sampling_params_factory: ``output_len -> SamplingParams``; default greedy, ignore_eos.

    Returns:
        a :class:`RunResult`, requests in workload order.

    Raises:
        RuntimeError: the engine has no unfinished requests while some were not returned
            as finished (an engine bug the bench should not hide).
    """
    if sampling_params_factory is None:
        from refengine import SamplingParams

        def sampling_params_factory(n: int):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    from tqdm import tqdm

    limit = max_concurrency if max_concurrency else len(requests)
    by_id = {r.request_id: r for r in requests}
    pending = collections.deque(requests)
    in_flight: set[str] = set()
    results: dict[str, RequestResult] = {}
    metrics = getattr(engine, "metrics", None)
    t_start_mono = time.monotonic()
    t_start = time.perf_counter()
    with tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False) as bar:
        while pending or in_flight:
            while pending and len(in_flight) < limit:
                req = pending.popleft()
                engine.add_request(req.request_id, list(req.prompt_token_ids),
                                   sampling_params_factory(req.output_len))
                in_flight.add(req.request_id)
            for out in engine.step():
                if not out.finished or out.request_id not in in_flight:
                    continue
                in_flight.discard(out.request_id)
                m = out.metrics
                if m.finished_time is None:  # engine did not stamp it: use when we saw it
                    m.on_finished(time.monotonic())
                results[out.request_id] = RequestResult.from_metrics(
                    by_id[out.request_id], m, out.outputs[0].token_ids)
                bar.update(1)
            if in_flight and not engine.has_unfinished_requests():
                raise RuntimeError(f"engine reports no unfinished requests but {sorted(in_flight)} "
                                   "never came back finished")
    elapsed = time.perf_counter() - t_start
    steps = [s for s in (metrics.steps if metrics is not None else []) if s.start >= t_start_mono]
    return RunResult(label=label, max_concurrency=max_concurrency, elapsed_s=elapsed,
                     requests=[results[r.request_id] for r in requests], steps=steps)


@dataclass
class EngineOptions:
    """The ``LLM(...)`` arguments a bench run uses (vLLM's knob names)."""

    model: str
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    num_kv_blocks: int | None = None

    def llm_kwargs(self) -> dict:
        kw = dataclasses.asdict(self)
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            # Without chunking a whole prompt must fit in one step's token budget.
            kw["max_num_batched_tokens"] = max(self.max_num_batched_tokens, self.max_model_len)
        return kw


def build_llm(options: EngineOptions):
    """Build ``refengine.LLM`` from ``options`` (stats logging off: the bench prints its own)."""
    from refengine import LLM

    return LLM(**options.llm_kwargs(), log_stats=False)


def warm_up(engine, corpus_ids: Sequence[int], progress: bool = False) -> None:
    """Two tiny requests through the engine so one-time costs stay out of the timed runs."""
    reqs = sample_requests(corpus_ids, 2, (8, 16), (4, 4), seed=12345, prefix=f"warmup{time.monotonic_ns()}")
    run_engine(engine, reqs, label="warmup", progress=progress)


# ---------------------------------------------------------------------------------------
# transformers, for comparison
# ---------------------------------------------------------------------------------------


def run_transformers(model_dir: str, requests: Sequence[BenchRequest], *, batch_size: int,
                     progress: bool = True, label: str = "transformers", device: str = "cpu",
                     dtype: str = "float32") -> RunResult:
    """The same requests through ``transformers`` ``generate`` (greedy, left padding).

    Batches are consecutive slices of ``batch_size`` requests (no sorting), each run to its
    longest output. See the module docstring for how times are measured.

    Args:
        device: torch device (``"cpu"``, ``"cuda"``); on CUDA each step stamp synchronizes.
        dtype: torch dtype name for the weights (``"float32"``, ``"float16"``, ``"bfloat16"``).
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    pad_id = _pad_token_id(model)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    class StepClock(LogitsProcessor):
        """Stamps ``time.monotonic()`` at each generation step (after the forward, before the pick)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            sync()
            self.times.append(time.monotonic())
            return scores

    def generate(batch: Sequence[BenchRequest], clock: StepClock):
        # Left padding, as `tokenizer(texts, padding=True)` with padding_side="left" gives:
        # pad ids on the left, attention_mask 0 there, so every row ends at the same column.
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            input_ids[j, width - n:] = torch.tensor(list(r.prompt_token_ids), dtype=torch.long)
            attention_mask[j, width - n:] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        n_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
        sync()
        return out[:, width:].cpu()

    generate([BenchRequest("warmup", list(requests[0].prompt_token_ids[:8]), 2)], StepClock())  # warm-up

    results: list[RequestResult] = []
    t_start = time.perf_counter()
    with tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False) as bar:
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            clock = StepClock()
            t0 = time.monotonic()
            new_tokens = generate(batch, clock)
            t1 = time.monotonic()
            for j, req in enumerate(batch):
                m = RequestMetrics(arrival_time=t0, num_prompt_tokens=len(req.prompt_token_ids))
                m.on_scheduled(t0)
                for t in clock.times[:req.output_len]:
                    m.on_token(t)
                m.on_finished(t1)
                results.append(RequestResult.from_metrics(req, m, new_tokens[j, :req.output_len].tolist()))
            bar.update(len(batch))
    elapsed = time.perf_counter() - t_start
    del model
    gc.collect()
    return RunResult(label=label, max_concurrency=batch_size, elapsed_s=elapsed, requests=results)


def _pad_token_id(model) -> int:
    """The model's pad id, else its (first) EOS id, else 0: padded positions are masked anyway."""
    for cfg in (model.generation_config, model.config):
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(cfg, name, None)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if v is not None:
                return int(v)
    return 0


def compare(ours: RunResult, theirs: RunResult) -> dict:
    """Ratios refengine / transformers (> 1 means refengine is faster) and greedy agreement.

    ``greedy_exact_match`` counts requests whose output token ids are identical in both
    runs; float32 differences in batched/padded math can flip a near-tie, so it is a
    sanity figure, not a correctness test (the golden tests are that).
    """
    def ratio(a, b):
        return a / b if b else None

    def lat(run, name):
        return run.latencies()[name]["median_ms"]

    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(ours.requests, theirs.requests))
    return {
        "output_throughput_ratio": ratio(ours.output_throughput, theirs.output_throughput),
        "request_throughput_ratio": ratio(ours.request_throughput, theirs.request_throughput),
        "total_token_throughput_ratio": ratio(ours.total_token_throughput, theirs.total_token_throughput),
        "median_ttft_ratio_theirs_over_ours": ratio(lat(theirs, "ttft"), lat(ours, "ttft")),
        "median_tpot_ratio_theirs_over_ours": ratio(lat(theirs, "tpot"), lat(ours, "tpot")),
        "greedy_exact_match": same,
        "num_requests": len(ours.requests),
    }


# ---------------------------------------------------------------------------------------
# Sweep and knee
# ---------------------------------------------------------------------------------------


def concurrency_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to ``max_concurrency``, which is always included as the last level."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    levels.append(max_concurrency)
    return levels


def find_knee(concurrency: Sequence[int], throughput: Sequence[float], latency: Sequence[float],
              min_gain: float = 0.10) -> int | None:
    """The concurrency past which more concurrency buys little throughput but costs latency.

    Walks the levels in order and returns the first ``concurrency[i]`` such that going to
    ``concurrency[i+1]`` raises throughput by less than ``min_gain`` (relative) while
    latency rises. Returns None when throughput keeps growing (or latency does not climb)
    up to the last level, i.e. no knee within the sweep.

    Args:
        concurrency: increasing levels.
        throughput: e.g. output tokens/s at each level.
        latency: e.g. median TPOT at each level (any unit; only the direction matters).
        min_gain: relative throughput gain below which growth counts as stopped (0.10 = 10 %).
    """
    if not len(concurrency) == len(throughput) == len(latency):
        raise ValueError("concurrency, throughput and latency must have the same length")
    for i in range(len(concurrency) - 1):
        if throughput[i] <= 0:
            continue
        gain = throughput[i + 1] / throughput[i] - 1.0
        if gain < min_gain and latency[i + 1] > latency[i]:
            return concurrency[i]
    return None


def sweep_table(runs: Sequence[RunResult], latency_metric: str = "tpot", min_gain: float = 0.10) -> dict:
    """Throughput and latency per concurrency level, and the knee (see :func:`find_knee`)."""
    levels = [r.max_concurrency for r in runs]
    thr = [r.output_throughput for r in runs]
    lat = [r.latencies()[latency_metric]["median_ms"] or 0.0 for r in runs]
    return {
        "concurrency": levels,
        "output_throughput": thr,
        "request_throughput": [r.request_throughput for r in runs],
        "median_ttft_ms": [r.latencies()["ttft"]["median_ms"] for r in runs],
        "median_tpot_ms": [r.latencies()["tpot"]["median_ms"] for r in runs],
        "p99_ttft_ms": [r.latencies()["ttft"]["p99_ms"] for r in runs],
        "p99_tpot_ms": [r.latencies()["tpot"]["p99_ms"] for r in runs],
        "knee_latency_metric": latency_metric,
        "knee_min_gain": min_gain,
        "knee_concurrency": find_knee(levels, thr, lat, min_gain),
    }


# ---------------------------------------------------------------------------------------
# Printing, JSON, plots
# ---------------------------------------------------------------------------------------


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain-text table, columns right-aligned, floats with two decimals, None as ``-``."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_run(run: RunResult) -> str:
    """A block of headline figures and a latency percentile table for one run."""
    s = run.summary()
    head = [
        f"=== {run.label} (max concurrency: {run.max_concurrency or 'all'}) ===",
        f"requests:               {s['num_requests']}",
        f"duration (s):           {s['elapsed_s']:.2f}",
        f"prompt tokens:          {s['total_prompt_tokens']}",
        f"output tokens:          {s['total_output_tokens']}",
        f"request throughput:     {_fmt(s['request_throughput'])} req/s",
        f"output throughput:      {_fmt(s['output_throughput'])} tok/s",
        f"total token throughput: {_fmt(s['total_token_throughput'])} tok/s",
    ]
    if s["requests_with_unexpected_output_len"]:
        head.append(f"WARNING: {len(s['requests_with_unexpected_output_len'])} requests produced "
                    "a different number of tokens than asked")
    cols = ["mean_ms"] + [f"p{p}_ms" for p in PERCENTILES]
    rows = [[name] + [summ[c] for c in cols] for name, summ in s["latency"].items()]
    return "\n".join(head) + "\n" + format_table(["latency (ms)"] + [c[:-3] for c in cols], rows)


def environment() -> dict:
    """Where the numbers came from: Python, NumPy, OS, CPU count, thread settings."""
    env = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:  # torch only if it is already loaded (the transformers comparison)
        if "torch" in sys.modules:
            env["torch"] = sys.modules["torch"].__version__
            env["torch_num_threads"] = sys.modules["torch"].get_num_threads()
        if "transformers" in sys.modules:
            env["transformers"] = sys.modules["transformers"].__version__
    except Exception:  # noqa: BLE001 - a version probe must never fail a benchmark
        pass
    return env


def busy_warning() -> str | None:
    """A warning when the machine is already busy (1-minute load average above half the CPUs).

    Other processes skew every figure, BLAS thread pools that spin-wait most of all.
    """
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cpus:
        return (f"WARNING: load average {load:.1f} on {cpus} CPUs before the run; "
                "other processes will skew the numbers")
    return None


def write_json(path: str | os.PathLike, report: dict) -> None:
    """Write ``report`` as indented JSON (infinities as null)."""
    def clean(o):
        if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    pathlib.Path(path).write_text(json.dumps(clean(report), indent=2), encoding="utf-8")


def plot_report(path: str | os.PathLike, runs: Sequence[RunResult], sweep: dict | None = None) -> None:
    """Save a PNG: throughput and latency vs concurrency (sweeps), and per-step timelines.

    A timeline shows, for each engine step of a refengine run, the prefill and the decode
    tokens it computed (stacked bars as wide as the step lasted), seconds from the run's
    first step. Runs without steps (transformers) get no timeline.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = [r for r in runs if r.steps]
    if sweep is not None:  # one timeline is enough: the highest concurrency
        timelines = timelines[-1:]
    n_panels = (2 if sweep is not None else 0) + len(timelines)
    if n_panels == 0:
        n_panels = 1
    fig, axes = plt.subplots(n_panels, 1, figsize=(10, 3.2 * n_panels), squeeze=False)
    axes = [a[0] for a in axes]
    k = 0
    if sweep is not None:
        c = sweep["concurrency"]
        ax = axes[k]
        ax.plot(c, sweep["output_throughput"], "o-", label="output tok/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        if sweep.get("knee_concurrency") is not None:
            ax.axvline(sweep["knee_concurrency"], color="gray", ls="--", label=f"knee = {sweep['knee_concurrency']}")
        ax.legend(loc="best")
        ax.set_title("throughput vs concurrency")
        ax = axes[k + 1]
        ax.plot(c, sweep["median_ttft_ms"], "o-", label="median TTFT")
        ax.plot(c, sweep["median_tpot_ms"], "s-", label="median TPOT")
        ax.plot(c, sweep["p99_tpot_ms"], "s--", label="P99 TPOT")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.legend(loc="best")
        ax.set_title("latency vs concurrency")
        k += 2
    for run in timelines:
        ax = axes[k]
        k += 1
        t0 = run.steps[0].start
        x = [s.start - t0 for s in run.steps]
        w = [max(s.duration, 1e-6) for s in run.steps]
        pre = [s.num_prefill_tokens for s in run.steps]
        dec = [s.num_decode_tokens for s in run.steps]
        ax.bar(x, pre, width=w, align="edge", label="prefill tokens", color="tab:orange", linewidth=0)
        ax.bar(x, dec, width=w, bottom=pre, align="edge", label="decode tokens", color="tab:blue", linewidth=0)
        ax.set_xlabel("seconds since first step")
        ax.set_ylabel("tokens per step")
        ax.set_title(f"step timeline: {run.label} (max concurrency {run.max_concurrency or 'all'})")
        ax.legend(loc="upper right")
    if k == 0:
        axes[0].text(0.5, 0.5, "no engine steps to plot", ha="center", va="center")
        axes[0].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Scenario plumbing
# ---------------------------------------------------------------------------------------


@dataclass
class BenchContext:
    """Everything a scenario needs from the command line."""

    options: EngineOptions
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    max_concurrency: int | None
    seed: int
    json_path: str | None
    plot_path: str | None
    trace_path: str | None
    data_dir: str | None
    progress: bool
    compare_transformers: bool = False
    hf_batch_size: int | None = None
    hf_dtype: str = "float32"
    warmup: bool = True
    echo: Callable[[str], None] = click.echo

    def needed_model_len(self) -> int:
        """Longest prompt plus longest output, rounded up to a whole KV block."""
        need = self.input_len[1] + self.output_len[1]
        bs = self.options.block_size
        return -(-need // bs) * bs


def _prepare(ctx: BenchContext, llm_factory=build_llm):
    """Build the engine and the workload; return (llm, engine, corpus_ids, requests)."""
    if ctx.options.max_model_len is None:
        ctx.options.max_model_len = ctx.needed_model_len()
    warning = busy_warning()
    if warning:
        ctx.echo(warning)
    ctx.echo(f"building engine: {ctx.options.llm_kwargs()}")
    llm = llm_factory(ctx.options)
    engine = llm.llm_engine
    if ctx.trace_path:
        engine.metrics.trace = True  # EngineMetrics checks the flag when it records and writes
    tokenizer = llm.get_tokenizer()
    corpus_ids = tokenizer.encode(load_corpus(ctx.data_dir))
    requests = sample_requests(corpus_ids, ctx.num_prompts, ctx.input_len, ctx.output_len, ctx.seed)
    if ctx.warmup:
        warm_up(engine, corpus_ids)
    return llm, engine, corpus_ids, requests


def _finish(ctx: BenchContext, scenario: str, runs: list[RunResult], engine=None, *,
            extra: dict | None = None, sweep: dict | None = None, settings: list[dict] | None = None) -> dict:
    """Print, and write the JSON / plot / trace files the flags asked for; return the report."""
    report = {
        "scenario": scenario,
        "workload": {"num_prompts": ctx.num_prompts, "input_len": list(ctx.input_len),
                     "output_len": list(ctx.output_len), "max_concurrency": ctx.max_concurrency,
                     "seed": ctx.seed, "data_dir": str(ctx.data_dir or DATA_DIR)},
        "engine_settings": settings if settings is not None else [dataclasses.asdict(ctx.options)],
        "environment": environment(),
        "runs": [r.to_dict() for r in runs],
    }
    if sweep is not None:
        report["sweep"] = sweep
    if extra:
        report.update(extra)
    if ctx.json_path:
        write_json(ctx.json_path, report)
        ctx.echo(f"wrote {ctx.json_path}")
    if ctx.plot_path:
        plot_report(ctx.plot_path, runs, sweep)
        ctx.echo(f"wrote {ctx.plot_path}")
    if ctx.trace_path and engine is not None:
        engine.metrics.write_trace(ctx.trace_path)
        ctx.echo(f"wrote {ctx.trace_path} (open in https://ui.perfetto.dev)")
    return report


# transformers pads each batch to its longest prompt and output, so a user batches modestly.
HF_DEFAULT_BATCH = 32


def _maybe_compare(ctx: BenchContext, ours: RunResult, requests) -> tuple[list[RunResult], dict | None]:
    if not ctx.compare_transformers:
        return [], None
    batch = ctx.hf_batch_size or ctx.max_concurrency or min(ctx.options.max_num_seqs, HF_DEFAULT_BATCH)
    theirs = run_transformers(ctx.options.model, requests, batch_size=batch, progress=ctx.progress,
                              device=ctx.options.device, dtype=ctx.hf_dtype)
    ctx.echo(format_run(theirs))
    cmp = compare(ours, theirs)
    ctx.echo(f"refengine / transformers: output throughput x{_fmt(cmp['output_throughput_ratio'])}, "
             f"total token throughput x{_fmt(cmp['total_token_throughput_ratio'])}; "
             f"median TTFT transformers/refengine x{_fmt(cmp['median_ttft_ratio_theirs_over_ours'])}, "
             f"median TPOT transformers/refengine x{_fmt(cmp['median_tpot_ratio_theirs_over_ours'])}; "
             f"identical greedy outputs: {cmp['greedy_exact_match']}/{cmp['num_requests']}")
    return [theirs], cmp


def run_simple(ctx: BenchContext, scenario: str, llm_factory=build_llm) -> dict:
    """One workload, one engine (``throughput``, ``chat``, ``generation``), optional comparison."""
    if ctx.max_concurrency:
        ctx.options.max_num_seqs = max(ctx.options.max_num_seqs, ctx.max_concurrency)
    llm, engine, _, requests = _prepare(ctx, llm_factory)
    ours = run_engine(engine, requests, max_concurrency=ctx.max_concurrency, progress=ctx.progress)
    ctx.echo(format_run(ours))
    theirs, cmp = _maybe_compare(ctx, ours, requests)
    return _finish(ctx, scenario, [ours] + theirs, engine, extra={"comparison": cmp} if cmp else None)


def run_long_context(ctx: BenchContext, llm_factory=build_llm) -> dict:
    """The same long-prompt workload with chunked prefill on, then off (a fresh engine each)."""
    if ctx.max_concurrency:
        ctx.options.max_num_seqs = max(ctx.options.max_num_seqs, ctx.max_concurrency)
    runs, settings, requests = [], [], None
    for chunked in (True, False):
        ctx.options.enable_chunked_prefill = chunked
        llm, engine, _, requests = _prepare(ctx, llm_factory)
        settings.append(ctx.options.llm_kwargs())
        run = run_engine(engine, requests, max_concurrency=ctx.max_concurrency, progress=ctx.progress,
                         label=f"refengine chunked_prefill={'on' if chunked else 'off'}")
        ctx.echo(format_run(run))
        runs.append(run)
        if ctx.trace_path:  # one trace per mode: NAME.chunked-on.json, NAME.chunked-off.json
            base, ext = os.path.splitext(ctx.trace_path)
            path = f"{base}.chunked-{'on' if chunked else 'off'}{ext or '.json'}"
            engine.metrics.write_trace(path)
            ctx.echo(f"wrote {path}")
        del llm, engine  # free the first model before loading the second
        gc.collect()
    on, off = runs
    ttft_on, ttft_off = on.latencies()["ttft"], off.latencies()["ttft"]
    itl_on, itl_off = on.latencies()["itl"], off.latencies()["itl"]
    ctx.echo(format_table(
        ["chunked prefill", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s"],
        [["on", ttft_on["median_ms"], ttft_on["p99_ms"], itl_on["median_ms"], itl_on["p99_ms"], on.output_throughput],
         ["off", ttft_off["median_ms"], ttft_off["p99_ms"], itl_off["median_ms"], itl_off["p99_ms"], off.output_throughput]]))
    theirs, cmp = _maybe_compare(ctx, on, requests)
    return _finish(ctx, "long-context", runs + theirs, None, settings=settings,
                   extra={"comparison": cmp} if cmp else None)


def run_sweep(ctx: BenchContext, latency_metric: str, min_gain: float, llm_factory=build_llm) -> dict:
    """The same workload at concurrency 1, 2, 4, ... ``max_concurrency`` on one engine."""
    top = ctx.max_concurrency or ctx.num_prompts
    levels = concurrency_levels(top)
    ctx.options.max_num_seqs = max(ctx.options.max_num_seqs, top)
    llm, engine, _, requests = _prepare(ctx, llm_factory)
    runs = []
    for c in levels:
        reqs = [dataclasses.replace(r, request_id=f"c{c}-{r.request_id}") for r in requests]
        run = run_engine(engine, reqs, max_concurrency=c, progress=ctx.progress, label=f"concurrency {c}")
        runs.append(run)
        ctx.echo(f"concurrency {c}: {run.output_throughput:.2f} output tok/s, "
                 f"median TTFT {_fmt(run.latencies()['ttft']['median_ms'])} ms, "
                 f"median TPOT {_fmt(run.latencies()['tpot']['median_ms'])} ms")
    sweep = sweep_table(runs, latency_metric, min_gain)
    ctx.echo(format_table(
        ["concurrency", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"],
        [[c, t, rq, a, b, d, e] for c, t, rq, a, b, d, e in zip(
            sweep["concurrency"], sweep["output_throughput"], sweep["request_throughput"],
            sweep["median_ttft_ms"], sweep["p99_ttft_ms"], sweep["median_tpot_ms"], sweep["p99_tpot_ms"])]))
    knee = sweep["knee_concurrency"]
    ctx.echo(f"knee: concurrency {knee} (beyond it output throughput grows < {min_gain:.0%} "
             f"while median {latency_metric.upper()} climbs)" if knee is not None
             else f"no knee up to concurrency {top}: throughput still grows >= {min_gain:.0%} per step")
    return _finish(ctx, "sweep", runs, engine, sweep=sweep)


# ---------------------------------------------------------------------------------------
# click commands
# ---------------------------------------------------------------------------------------


def _len_type(value):
    try:
        return parse_len_range(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _options(*, num_prompts: int, input_len: str, output_len: str, max_concurrency: int | None,
             max_num_seqs: int, max_num_batched_tokens: int, compare: bool):
    """The flags every scenario shares, with that scenario's defaults."""
    def deco(f):
        opts = [
            click.option("--model", default=default_model_dir, show_default="$REFENGINE_MODEL or " + DEFAULT_MODEL,
                         help="Model directory (HF layout)."),
            click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
            click.option("--num-prompts", type=int, default=num_prompts, show_default=True,
                         help="Number of requests."),
            click.option("--input-len", default=input_len, show_default=True,
                         help="Prompt length in tokens: N, or LO-HI for seeded uniform lengths."),
            click.option("--output-len", default=output_len, show_default=True,
                         help="Output length in tokens: N, or LO-HI (EOS ignored)."),
            click.option("--max-concurrency", type=int, default=max_concurrency, show_default=True,
                         help="Most requests in flight (unset: all submitted at once)."),
            click.option("--seed", type=int, default=0, show_default=True, help="Workload seed."),
            click.option("--max-num-seqs", type=int, default=max_num_seqs, show_default=True,
                         help="Engine: most sequences per step (raised to --max-concurrency if lower)."),
            click.option("--max-num-batched-tokens", type=int, default=max_num_batched_tokens, show_default=True,
                         help="Engine: token budget per step."),
            click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=True, show_default=True,
                         help="Engine: split long prompts across steps."),
            click.option("--block-size", type=int, default=16, show_default=True, help="Engine: KV block size."),
            click.option("--max-model-len", type=int, default=None,
                         help="Engine: context limit (default: longest prompt + longest output)."),
            click.option("--num-kv-blocks", type=int, default=None, help="Engine: KV blocks (default: engine's choice)."),
            click.option("--dataset-dir", default=None, help="Directory of .txt files to cut prompts from "
                         "(default: benchmarks/data)."),
            click.option("--json", "json_path", default=None, help="Write every figure and the engine settings here."),
            click.option("--plot", "plot_path", default=None, help="Write a PNG of the results here."),
            click.option("--trace", "trace_path", default=None,
                         help="Write a Chrome trace (Perfetto) of the engine steps here."),
            click.option("--disable-tqdm", is_flag=True, help="No progress bars."),
            click.option("--no-warmup", is_flag=True, help="Skip the two warm-up requests."),
        ]
        if compare:
            opts += [
                click.option("--compare-transformers", is_flag=True,
                             help="Also run the requests through transformers generate (same run)."),
                click.option("--hf-batch-size", type=int, default=None,
                             help="transformers batch size (default: --max-concurrency, else "
                                  "--max-num-seqs capped at 32)."),
                click.option("--hf-dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
                             default="float32", show_default=True, help="transformers weight dtype."),
            ]
        for opt in reversed(opts):
            f = opt(f)
        return f
    return deco


def _context(kw: dict) -> BenchContext:
    options = EngineOptions(model=kw["model"], device=kw["device"], block_size=kw["block_size"],
                            max_num_seqs=kw["max_num_seqs"], max_num_batched_tokens=kw["max_num_batched_tokens"],
                            enable_chunked_prefill=kw["enable_chunked_prefill"],
                            max_model_len=kw["max_model_len"], num_kv_blocks=kw["num_kv_blocks"])
    return BenchContext(options=options, num_prompts=kw["num_prompts"], input_len=_len_type(kw["input_len"]),
                        output_len=_len_type(kw["output_len"]), max_concurrency=kw["max_concurrency"],
                        seed=kw["seed"], json_path=kw["json_path"], plot_path=kw["plot_path"],
                        trace_path=kw["trace_path"], data_dir=kw["dataset_dir"], progress=not kw["disable_tqdm"],
                        compare_transformers=kw.get("compare_transformers", False),
                        hf_batch_size=kw.get("hf_batch_size"), hf_dtype=kw.get("hf_dtype", "float32"),
                        warmup=not kw["no_warmup"])


def _check_model(path: str) -> None:
    if not os.path.isdir(path):
        raise click.UsageError(f"model directory {path!r} not found (set --model or $REFENGINE_MODEL)")


@click.group("bench")
def bench():
    """Throughput and latency benchmarks (see `refengine bench SCENARIO --help`)."""


@bench.command("throughput")
@_options(num_prompts=64, input_len="16-512", output_len="16-256", max_concurrency=None,
          max_num_seqs=256, max_num_batched_tokens=2048, compare=True)  # the engine's own defaults
def throughput_cmd(**kw):
    """N requests of random lengths submitted at once: requests/s and tokens/s."""
    _check_model(kw["model"])
    run_simple(_context(kw), "throughput")


@bench.command("chat")
@_options(num_prompts=32, input_len="32-128", output_len="32-128", max_concurrency=8,
          max_num_seqs=8, max_num_batched_tokens=512, compare=False)
def chat_cmd(**kw):
    """Short prompts and answers at fixed concurrency: P50/P90/P99 TTFT and TPOT."""
    _check_model(kw["model"])
    run_simple(_context(kw), "chat")


@bench.command("generation")
@_options(num_prompts=16, input_len="16-64", output_len="256", max_concurrency=None,
          max_num_seqs=16, max_num_batched_tokens=512, compare=True)
def generation_cmd(**kw):
    """Short prompts, long outputs: decode throughput."""
    _check_model(kw["model"])
    run_simple(_context(kw), "generation")


@bench.command("long-context")
@_options(num_prompts=8, input_len="1024", output_len="16", max_concurrency=4,
          max_num_seqs=4, max_num_batched_tokens=512, compare=True)
def long_context_cmd(**kw):
    """Long prompts, short outputs, chunked prefill on vs off: TTFT and inter-token latency."""
    _check_model(kw["model"])
    run_long_context(_context(kw))


@bench.command("sweep")
@_options(num_prompts=16, input_len="128", output_len="64", max_concurrency=16,
          max_num_seqs=16, max_num_batched_tokens=512, compare=False)
@click.option("--latency-metric", type=click.Choice(["tpot", "ttft", "e2e", "itl"]), default="tpot",
              show_default=True, help="Latency whose climb marks the knee.")
@click.option("--min-gain", type=float, default=0.10, show_default=True,
              help="Relative throughput gain below which growth counts as stopped.")
def sweep_cmd(latency_metric, min_gain, **kw):
    """One workload at concurrency 1, 2, 4 .. N: throughput and latency curves, and the knee."""
    _check_model(kw["model"])
    run_sweep(_context(kw), latency_metric, min_gain)


if __name__ == "__main__":
    bench()
