"""Driving ``LLMEngine`` through a workload, closed loop, and what one run measured.

The bench drives ``LLMEngine`` directly (``add_request`` / ``step``), closed loop: it
keeps at most ``max_concurrency`` requests in flight and adds the next one as soon as one
finishes; with no limit every request is added before the first step (offline batch, as
``LLM.generate`` does). A request's TTFT is measured from its ``add_request``.

Units: times in seconds in per-request records, milliseconds in summaries (keys end in
``_ms``); throughputs in requests/s or tokens/s.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from refengine.bench.workload import BenchRequest, sample_requests
from refengine.metrics import RequestMetrics, StepRecord, percentile


PERCENTILES = (50, 90, 99)


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


def latency_figures(values_s: Iterable[float | None], percentiles: Iterable[float] = PERCENTILES) -> dict:
    """Latencies given in seconds, in milliseconds: ``mean``, ``median``, ``std`` (population),
    ``min``, ``max``, and ``p<q>`` for each ``q`` of ``percentiles`` (0-100; the key as
    ``f"p{q:g}"``: ``p99``, ``p99.9``).

    Missing values (None) are skipped; every figure is None when nothing is left.
    """
    qs = list(percentiles)
    ms = [1000.0 * v for v in values_s if v is not None]
    keys = ["mean", "median", "std", "min", "max"] + [f"p{q:g}" for q in qs]
    if not ms:
        return dict.fromkeys(keys)
    mean = sum(ms) / len(ms)
    out = {"mean": mean, "median": percentile(ms, 50), "std": (sum((x - mean) ** 2 for x in ms) / len(ms)) ** 0.5,
           "min": min(ms), "max": max(ms)}
    out.update({f"p{q:g}": percentile(ms, q) for q in qs})
    return out


def latency_summary(values_s: Iterable[float | None]) -> dict:
    """Mean, median, P90, P99, min, max of latencies given in seconds, reported in milliseconds
    (:func:`latency_figures`, keys ending in ``_ms``).

    Missing values (None) are skipped; every figure is None when nothing is left.
    """
    figures = latency_figures(values_s)
    keys = ["mean", "median"] + [f"p{p}" for p in PERCENTILES] + ["min", "max"]
    return {f"{k}_ms": figures[k] for k in keys}


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
        progress: show a tqdm bar of finished requests (only when stderr is a terminal).
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
    with tqdm(total=len(requests), desc=label, unit="req", disable=None if progress else True, leave=False) as bar:
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


def build_llm(engine_kwargs: dict):
    """``refengine.LLM(**engine_kwargs)``: the engine a scenario measures.

    Args:
        engine_kwargs: ``LLMEngine`` keyword arguments, ``model`` included, as
            :func:`refengine.bench.options.engine_kwargs` makes them from the engine flags (so the
            bench runs with the engine's own defaults).

    Raises:
        whatever ``LLMEngine`` raises for bad settings (``ValueError``, ``FileNotFoundError``,
        ``RuntimeError``).
    """
    from refengine import LLM

    return LLM(**engine_kwargs)


def warm_up(engine, corpus_ids: Sequence[int], progress: bool = False) -> None:
    """Two tiny requests through the engine so one-time costs stay out of the timed runs."""
    reqs = sample_requests(corpus_ids, 2, (8, 16), (4, 4), seed=12345, prefix=f"warmup{time.monotonic_ns()}")
    run_engine(engine, reqs, label="warmup", progress=progress)
