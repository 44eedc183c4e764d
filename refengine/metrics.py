"""Metrics: per request, per engine step, Prometheus exposition and a Chrome trace.

Two objects, both plain Python:

- :class:`RequestMetrics` rides along with one request. The engine stamps it when the
  request is first scheduled, each time it produces a token and when it finishes; every
  latency figure (TTFT, TPOT, inter-token latencies, end-to-end, queue, prefill, decode)
  is derived from those timestamps, so a test can drive it with a scripted clock.
- :class:`EngineMetrics` belongs to one engine. The engine calls :meth:`~EngineMetrics.record_step`
  once per ``step()`` and the ``record_*`` methods per token / request. It keeps
  Prometheus counters, gauges and histograms (names mirror vLLM's ``vllm:*`` metrics
  with the ``refengine:`` prefix), a list of per-step records (for plots and the
  Chrome trace) and the running sums behind the engine's periodic log line.

All times are seconds from ``time.monotonic()`` (any monotonic clock works, as long as
one request's stamps all come from the same clock). Token counts are integers.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# ---------------------------------------------------------------------------------------
# Per request
# ---------------------------------------------------------------------------------------


@dataclass
class RequestMetrics:
    """Timestamps of one request's life, and the latencies derived from them.

    All times are seconds on the engine's monotonic clock. Derived figures are ``None``
    while the stamps they need are missing (for example ``ttft`` before the first token).

    Attributes:
        arrival_time: when the request entered the engine (``add_request``).
        num_prompt_tokens: prompt length in tokens.
        first_scheduled_time: when the scheduler first gave it compute (start of the step).
        first_token_time: when its first output token was produced.
        finished_time: when it finished (stop, length or abort).
        token_times: one entry per output token of every completion (``n > 1``), the
            time it was produced.
        inter_token_latencies: seconds between consecutive tokens of the same completion.
    """

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    _last_token_time: dict = field(default_factory=dict, repr=False)

    # --- stamps (called by the engine) ----------------------------------------------
    def on_scheduled(self, now: float) -> None:
        """The scheduler gave this request compute in a step starting at ``now``.

        Only the first call counts (a preempted request that is rescheduled keeps its
        original ``first_scheduled_time``).
        """
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def on_token(self, now: float, index: int = 0) -> float | None:
        """Completion ``index`` produced one output token at ``now``.

        Returns:
            The inter-token latency it adds (seconds since that completion's previous
            token), or None for a completion's first token.
        """
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        last = self._last_token_time.get(index)
        self._last_token_time[index] = now
        if last is None:
            return None
        self.inter_token_latencies.append(now - last)
        return now - last

    def on_finished(self, now: float) -> None:
        """The request finished at ``now`` (first call wins)."""
        if self.finished_time is None:
            self.finished_time = now

    # --- derived ------------------------------------------------------------------------
    @property
    def num_output_tokens(self) -> int:
        """Output tokens produced so far, all completions together (``len(token_times)``)."""
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds: ``first_token_time - arrival_time``."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token, seconds: the mean inter-token latency over every completion.

        With one completion this is ``(last_token_time - first_token_time) / (num_output_tokens - 1)``;
        ``None`` without any two consecutive tokens.
        """
        gaps = self.inter_token_latencies
        if not gaps:
            return None
        return sum(gaps) / len(gaps)

    @property
    def e2e_latency(self) -> float | None:
        """End-to-end latency, seconds: ``finished_time - arrival_time``."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds spent waiting before first scheduled: ``first_scheduled_time - arrival_time``."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """Seconds from first scheduled to first token (all prefill chunks and their waits)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from first token to finish."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time

    def summary(self) -> dict:
        """Every stamp and derived figure as a JSON-ready dict (seconds, token counts)."""
        return {
            "arrival_time": self.arrival_time,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e_latency": self.e2e_latency,
            "queue_time": self.queue_time,
            "prefill_time": self.prefill_time,
            "decode_time": self.decode_time,
        }


# ---------------------------------------------------------------------------------------
# Per engine
# ---------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """What happened in one engine step.

    Attributes:
        start: step start, seconds (monotonic clock).
        duration: wall time of the step, seconds.
        num_prefill_tokens: prompt (or recompute) tokens run through the model.
        num_decode_tokens: decode tokens run through the model (one per decoding sequence).
        num_generated_tokens: tokens sampled this step (decodes plus prefills that completed).
        num_seqs: sequences in the batch.
        num_running: sequences in RUNNING after the step.
        num_waiting: sequences in WAITING after the step.
        kv_cache_usage: fraction of KV blocks in use, 0-1.
        num_preemptions: sequences preempted in this step.
        prefix_cache_queries: tokens of the sequences admitted this step looked up in the
            prefix cache (0 with caching off).
        prefix_cache_hits: of those, tokens found cached (not computed).
    """

    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    num_seqs: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_batched_tokens(self) -> int:
        """All tokens run through the model in this step."""
        return self.num_prefill_tokens + self.num_decode_tokens


# Histogram buckets. Upper bounds; Prometheus adds +Inf. Chosen for a CPU engine (slow)
# that may also run on a GPU (fast), so they span milliseconds to tens of minutes.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
REQUEST_LATENCY_BUCKETS_S = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 3840.0)


def token_count_buckets(max_value: int = 1_000_000) -> tuple[float, ...]:
    """1-2-5 series (1, 2, 5, 10, 20, 50, ...) up to ``max_value``, for token-count histograms."""
    out, mantissas, scale = [], (1, 2, 5), 1
    while True:
        for m in mantissas:
            if m * scale > max_value:
                return tuple(float(v) for v in out)
            out.append(m * scale)
        scale *= 10


TOKEN_COUNT_BUCKETS = token_count_buckets(1_000_000)


class EngineMetrics:
    """Counters, gauges, histograms and per-step records for one engine.

    Prometheus metrics (exposed names; ``_total``, ``_bucket``, ``_sum``, ``_count``
    suffixes as the text format adds them):

    ======================================================  =========  =================================
    name                                                    type       meaning
    ======================================================  =========  =================================
    ``refengine:prompt_tokens_total``                       counter    prefill tokens computed (incl. recompute)
    ``refengine:generation_tokens_total``                   counter    output tokens sampled
    ``refengine:request_success_total{finished_reason}``    counter    finished requests, by stop/length/abort/error
    ``refengine:num_preemptions_total``                     counter    preemptions (by recompute)
    ``refengine:prefix_cache_queries_total``                counter    tokens looked up in the prefix cache
    ``refengine:prefix_cache_hits_total``                   counter    of those, tokens found (not computed)
    ``refengine:num_requests_running``                      gauge      sequences RUNNING after the last step
    ``refengine:num_requests_waiting``                      gauge      sequences WAITING after the last step
    ``refengine:kv_cache_usage_perc``                       gauge      KV blocks in use, fraction 0-1
    ``refengine:time_to_first_token_seconds``               histogram  TTFT per request
    ``refengine:inter_token_latency_seconds``               histogram  gap between consecutive output tokens
    ``refengine:e2e_request_latency_seconds``               histogram  arrival to finish per request
    ``refengine:request_time_per_output_token_seconds``     histogram  TPOT per request (first token excluded)
    ``refengine:request_queue_time_seconds``                histogram  arrival to first scheduled
    ``refengine:request_prefill_time_seconds``              histogram  first scheduled to first token
    ``refengine:request_decode_time_seconds``               histogram  first token to finish
    ``refengine:request_prompt_tokens``                     histogram  prompt length per finished request
    ``refengine:request_generation_tokens``                 histogram  output length per finished request
    ``refengine:iteration_tokens_total``                    histogram  tokens run through the model per step
    ``refengine:spec_decode_num_drafts``                    counter    speculative decoding: verifications of proposals
    ``refengine:spec_decode_num_draft_tokens``              counter    proposed tokens verified
    ``refengine:spec_decode_num_accepted_tokens``           counter    proposed tokens accepted
    ``refengine:spec_decode_num_accepted_tokens_per_pos``   counter    accepted, by position (label ``position``, from 0)
    ======================================================  =========  =================================

    Speculative decoding (vLLM's names and definitions): acceptance rate =
    accepted / draft tokens; mean acceptance length = 1 + accepted / drafts, the tokens one
    sequence gains per verifying step (k + 1 when every proposal of k is accepted).

    Args:
        registry: where the metrics are registered. Default: a fresh
            ``CollectorRegistry`` of this engine's own, so several engines in one process
            don't clash. Pass ``prometheus_client.REGISTRY`` to publish on the global one.
        trace: keep what :meth:`write_trace` needs (steps are always kept; with
            ``trace`` also per-request spans).
        max_steps: most step records kept in :attr:`steps` (oldest dropped first), so a
            long-running server's memory stays bounded.
        clock: the clock used for the log-line throughput windows (seconds).

    Attributes:
        steps: the last ``max_steps`` :class:`StepRecord` s, oldest first.
    """

    def __init__(self, registry: CollectorRegistry | None = None, trace: bool = False,
                 max_steps: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.trace = trace
        self.clock = clock
        self.steps: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._request_spans: list[dict] = []  # only filled when trace=True
        self._num_finished = 0

        r = self.registry
        # prometheus_client appends "_total" to counter names itself, so the base names
        # here have no suffix and come out exactly as `refengine:..._total`.
        self.prompt_tokens = Counter(
            "refengine:prompt_tokens", "Number of prefill tokens processed (including recompute after preemption).",
            registry=r)
        self.generation_tokens = Counter(
            "refengine:generation_tokens", "Number of generation tokens processed.", registry=r)
        self.request_success = Counter(
            "refengine:request_success", "Count of finished requests, by finish reason.",
            ["finished_reason"], registry=r)
        self.num_preemptions = Counter(
            "refengine:num_preemptions", "Cumulative number of preemptions.", registry=r)
        self.prefix_cache_queries = Counter(
            "refengine:prefix_cache_queries", "Prefix cache queries, in tokens (admitted sequences' lengths).",
            registry=r)
        self.prefix_cache_hits = Counter(
            "refengine:prefix_cache_hits", "Prefix cache hits, in tokens (found cached, not computed).", registry=r)

        self.num_requests_running = Gauge(
            "refengine:num_requests_running", "Requests (sequences) RUNNING after the last step.", registry=r)
        self.num_requests_waiting = Gauge(
            "refengine:num_requests_waiting", "Requests (sequences) WAITING after the last step.", registry=r)
        self.kv_cache_usage = Gauge(
            "refengine:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", registry=r)

        self.ttft_hist = Histogram(
            "refengine:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS_S, registry=r)
        self.itl_hist = Histogram(
            "refengine:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS_S, registry=r)
        self.e2e_hist = Histogram(
            "refengine:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.tpot_hist = Histogram(
            "refengine:request_time_per_output_token_seconds",
            "Histogram of time per output token (first token excluded) per request, seconds.",
            buckets=ITL_BUCKETS_S, registry=r)
        self.queue_hist = Histogram(
            "refengine:request_queue_time_seconds", "Histogram of time spent waiting before first scheduled, seconds.",
            buckets=TTFT_BUCKETS_S, registry=r)
        self.prefill_hist = Histogram(
            "refengine:request_prefill_time_seconds", "Histogram of time from first scheduled to first token, seconds.",
            buckets=TTFT_BUCKETS_S, registry=r)
        self.decode_hist = Histogram(
            "refengine:request_decode_time_seconds", "Histogram of time from first token to finish, seconds.",
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens_hist = Histogram(
            "refengine:request_prompt_tokens", "Number of prefill tokens per finished request.",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.generation_tokens_hist = Histogram(
            "refengine:request_generation_tokens", "Number of generation tokens per finished request.",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.iteration_tokens_hist = Histogram(
            "refengine:iteration_tokens_total", "Histogram of tokens run through the model per engine step.",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)

        self.spec_num_drafts = Counter(
            "refengine:spec_decode_num_drafts", "Number of speculative decoding drafts (verifications).", registry=r)
        self.spec_num_draft_tokens = Counter(
            "refengine:spec_decode_num_draft_tokens", "Number of proposed (draft) tokens verified.", registry=r)
        self.spec_num_accepted_tokens = Counter(
            "refengine:spec_decode_num_accepted_tokens", "Number of proposed tokens accepted.", registry=r)
        self.spec_num_accepted_tokens_per_pos = Counter(
            "refengine:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by position in the draft.",
            ["position"], registry=r)

        # Running totals (plain numbers, cheaper to read than the Prometheus objects).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_preemptions = 0
        self.total_prefix_cache_queries = 0
        self.total_prefix_cache_hits = 0
        self._last: StepRecord | None = None
        self._log_prompt_tokens = 0
        self._log_generation_tokens = 0
        self._log_cache_queries = 0
        self._log_cache_hits = 0
        self._log_time = clock()
        self.spec_totals = _spec_counts()  # since the engine started
        self._log_spec = _spec_counts()  # since the last log line

    # --- called by the engine -----------------------------------------------------------
    def record_step(self, *, step_start: float, step_duration: float, num_prefill_tokens: int,
                    num_decode_tokens: int, num_seqs: int, num_running: int, num_waiting: int,
                    kv_cache_usage: float, num_preemptions: int,
                    num_generated_tokens: int | None = None, prefix_cache_queries: int = 0,
                    prefix_cache_hits: int = 0) -> None:
        """Record one engine step.

        Args:
            step_start: when the step began, seconds (monotonic).
            step_duration: its wall time, seconds.
            num_prefill_tokens: prompt / recompute tokens computed in the step.
            num_decode_tokens: decode tokens computed (one per decoding sequence).
            num_seqs: sequences in the batch.
            num_running, num_waiting: queue lengths after the step.
            kv_cache_usage: fraction of KV blocks in use after the step, 0-1.
            num_preemptions: sequences preempted during this step.
            num_generated_tokens: tokens sampled this step. A sequence whose prefill
                completes samples its first token too, so this is usually
                ``num_decode_tokens`` plus the completed prefills. Default:
                ``num_decode_tokens``.
            prefix_cache_queries, prefix_cache_hits: tokens of the sequences admitted this
                step looked up in / found in the prefix cache.
        """
        if num_generated_tokens is None:
            num_generated_tokens = num_decode_tokens
        rec = StepRecord(start=step_start, duration=step_duration,
                         num_prefill_tokens=int(num_prefill_tokens), num_decode_tokens=int(num_decode_tokens),
                         num_generated_tokens=int(num_generated_tokens), num_seqs=int(num_seqs),
                         num_running=int(num_running), num_waiting=int(num_waiting),
                         kv_cache_usage=float(kv_cache_usage), num_preemptions=int(num_preemptions),
                         prefix_cache_queries=int(prefix_cache_queries), prefix_cache_hits=int(prefix_cache_hits))
        self.steps.append(rec)
        self._last = rec

        self.prompt_tokens.inc(rec.num_prefill_tokens)
        self.generation_tokens.inc(rec.num_generated_tokens)
        self.num_preemptions.inc(rec.num_preemptions)
        self.prefix_cache_queries.inc(rec.prefix_cache_queries)
        self.prefix_cache_hits.inc(rec.prefix_cache_hits)
        self.num_requests_running.set(rec.num_running)
        self.num_requests_waiting.set(rec.num_waiting)
        self.kv_cache_usage.set(rec.kv_cache_usage)
        if rec.num_batched_tokens:
            self.iteration_tokens_hist.observe(rec.num_batched_tokens)

        self.total_prompt_tokens += rec.num_prefill_tokens
        self.total_generation_tokens += rec.num_generated_tokens
        self.total_preemptions += rec.num_preemptions
        self._log_prompt_tokens += rec.num_prefill_tokens
        self._log_generation_tokens += rec.num_generated_tokens
        self.total_prefix_cache_queries += rec.prefix_cache_queries
        self.total_prefix_cache_hits += rec.prefix_cache_hits
        self._log_cache_queries += rec.prefix_cache_queries
        self._log_cache_hits += rec.prefix_cache_hits

    def record_spec_decode(self, stats) -> None:
        """One step's speculative decoding counts (a :class:`refengine.spec_decode.SpecDecodeStats`:
        ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
        ``num_accepted_tokens_per_pos``)."""
        self.spec_num_drafts.inc(stats.num_drafts)
        self.spec_num_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_num_accepted_tokens.inc(stats.num_accepted_tokens)
        for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
            self.spec_num_accepted_tokens_per_pos.labels(position=str(pos)).inc(n)
        for counts in (self.spec_totals, self._log_spec):
            counts["num_drafts"] += stats.num_drafts
            counts["num_draft_tokens"] += stats.num_draft_tokens
            counts["num_accepted_tokens"] += stats.num_accepted_tokens
            per_pos = counts["num_accepted_tokens_per_pos"]
            per_pos.extend([0] * (len(stats.num_accepted_tokens_per_pos) - len(per_pos)))
            for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
                per_pos[pos] += n

    def record_token_latency(self, seconds: float) -> None:
        """One inter-token latency sample (gap between two consecutive tokens of a request), seconds."""
        self.itl_hist.observe(seconds)

    def record_first_token(self, ttft: float) -> None:
        """A request produced its first token ``ttft`` seconds after it arrived."""
        self.ttft_hist.observe(ttft)

    def record_finished(self, m: RequestMetrics, finish_reason: str, request_id: str | None = None) -> None:
        """A request finished: count it and observe its whole-request histograms.

        Args:
            m: its metrics, with ``finished_time`` stamped (if not, nothing time-based
                that needs it is observed).
            finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (the label value).
            request_id: used only to name the request's row in the Chrome trace.
        """
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens_hist.observe(m.num_prompt_tokens)
        self.generation_tokens_hist.observe(m.num_output_tokens)
        for hist, value in ((self.e2e_hist, m.e2e_latency), (self.tpot_hist, m.tpot), (self.queue_hist, m.queue_time),
                            (self.prefill_hist, m.prefill_time), (self.decode_hist, m.decode_time)):
            if value is not None:
                hist.observe(value)
        self._num_finished += 1
        if self.trace:
            self._request_spans.append({
                "request_id": request_id if request_id is not None else f"req-{self._num_finished}",
                "finish_reason": finish_reason,
                "arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
                "first_token_time": m.first_token_time, "finished_time": m.finished_time,
                "num_prompt_tokens": m.num_prompt_tokens, "num_output_tokens": m.num_output_tokens,
            })

    # --- reading ------------------------------------------------------------------------
    def exposition(self) -> str:
        """The registry in Prometheus text format (what a ``/metrics`` endpoint serves)."""
        return prometheus_client.generate_latest(_WithoutCreated(self.registry)).decode("utf-8")

    def stats_since_last_log(self) -> dict:
        """Figures for the engine's periodic log line; resets the "since last" window.

        Returns:
            dict with ``num_running``, ``num_waiting`` (after the last step),
            ``prompt_tokens`` and ``generation_tokens`` (since the previous call),
            ``interval_s`` (seconds since the previous call), ``prompt_throughput`` and
            ``generation_throughput`` (tokens/s over that interval), ``kv_cache_usage_perc``
            (percent, 0-100), ``num_preemptions_total`` (since the engine started),
            ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens, since the previous
            call) and ``prefix_cache_hit_rate`` (percent of those queried tokens found
            cached, 0-100; 0 without queries), and speculative decoding's figures since the
            previous call (:func:`spec_decode_summary`, keys prefixed ``spec_decode_``; rates
            None without drafts).
        """
        now = self.clock()
        interval = max(now - self._log_time, 1e-9)
        last = self._last
        stats = {
            "num_running": last.num_running if last else 0,
            "num_waiting": last.num_waiting if last else 0,
            "prompt_tokens": self._log_prompt_tokens,
            "generation_tokens": self._log_generation_tokens,
            "interval_s": interval,
            "prompt_throughput": self._log_prompt_tokens / interval,
            "generation_throughput": self._log_generation_tokens / interval,
            "kv_cache_usage_perc": 100.0 * (last.kv_cache_usage if last else 0.0),
            "num_preemptions_total": self.total_preemptions,
            "prefix_cache_queries": self._log_cache_queries,
            "prefix_cache_hits": self._log_cache_hits,
            "prefix_cache_hit_rate": 100.0 * self._log_cache_hits / max(self._log_cache_queries, 1),
            **{f"spec_decode_{k}": v for k, v in spec_decode_summary(self._log_spec).items()},
        }
        self._log_prompt_tokens = 0
        self._log_generation_tokens = 0
        self._log_cache_queries = 0
        self._log_cache_hits = 0
        self._log_time = now
        self._log_spec = _spec_counts()
        return stats

    @staticmethod
    def format_log_line(stats: dict) -> str:
        """One line in vLLM's style from :meth:`stats_since_last_log`'s dict."""
        return (f"Avg prompt throughput: {stats['prompt_throughput']:.1f} tokens/s, "
                f"Avg generation throughput: {stats['generation_throughput']:.1f} tokens/s, "
                f"Running: {stats['num_running']} reqs, Waiting: {stats['num_waiting']} reqs, "
                f"KV cache usage: {stats['kv_cache_usage_perc']:.1f}%, "
                f"Prefix cache hit rate: {stats.get('prefix_cache_hit_rate', 0.0):.1f}%, "
                f"Preemptions: {stats['num_preemptions_total']}" + _spec_log_text(stats))

    # --- Chrome trace -------------------------------------------------------------------
    def trace_events(self) -> list[dict]:
        """The steps (and, with ``trace=True``, request spans) as Chrome trace events.

        Times are microseconds from the first recorded event. Process 1 holds the engine
        steps (one complete event per step, args = token counts) and counter tracks
        (tokens per step, queue lengths, KV usage); process 2 holds one row per finished
        request with its queue / prefill / decode phases.
        """
        starts = [s.start for s in self.steps] + [r["arrival_time"] for r in self._request_spans]
        if not starts:
            return []
        t0 = min(starts)

        def us(t: float) -> float:
            return round((t - t0) * 1e6, 3)

        events: list[dict] = [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "refengine engine"}},
            {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "step"}},
        ]
        for i, s in enumerate(self.steps):
            kind = ("prefill+decode" if s.num_prefill_tokens and s.num_decode_tokens
                    else "prefill" if s.num_prefill_tokens else "decode")
            events.append({"ph": "X", "pid": 1, "tid": 1, "name": kind, "cat": "step",
                           "ts": us(s.start), "dur": round(s.duration * 1e6, 3),
                           "args": {"step": i, **{k: v for k, v in asdict(s).items()
                                                  if k not in ("start", "duration")}}})
            events.append({"ph": "C", "pid": 1, "name": "tokens", "ts": us(s.start),
                           "args": {"prefill": s.num_prefill_tokens, "decode": s.num_decode_tokens}})
            events.append({"ph": "C", "pid": 1, "name": "requests", "ts": us(s.start + s.duration),
                           "args": {"running": s.num_running, "waiting": s.num_waiting}})
            events.append({"ph": "C", "pid": 1, "name": "kv_cache_usage_perc", "ts": us(s.start + s.duration),
                           "args": {"usage": round(100.0 * s.kv_cache_usage, 3)}})
        if self._request_spans:
            events.append({"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "requests"}})
        for tid, r in enumerate(self._request_spans, start=1):
            events.append({"ph": "M", "pid": 2, "tid": tid, "name": "thread_name",
                           "args": {"name": str(r["request_id"])}})
            phases = [("queue", r["arrival_time"], r["first_scheduled_time"]),
                      ("prefill", r["first_scheduled_time"], r["first_token_time"]),
                      ("decode", r["first_token_time"], r["finished_time"])]
            for name, a, b in phases:
                if a is None or b is None:
                    continue
                events.append({"ph": "X", "pid": 2, "tid": tid, "name": name, "cat": "request",
                               "ts": us(a), "dur": round((b - a) * 1e6, 3),
                               "args": {"prompt_tokens": r["num_prompt_tokens"],
                                        "output_tokens": r["num_output_tokens"],
                                        "finish_reason": r["finish_reason"]}})
        return events

    def write_trace(self, path: str | os.PathLike) -> None:
        """Write a Chrome trace JSON (open it in https://ui.perfetto.dev or chrome://tracing).

        Raises:
            RuntimeError: the metrics were built with ``trace=False``.
        """
        if not self.trace:
            raise RuntimeError("EngineMetrics(trace=False): build it with trace=True to write a trace")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}, f)


# ---------------------------------------------------------------------------------------
# Small statistics helpers shared with the bench
# ---------------------------------------------------------------------------------------


def _spec_counts() -> dict:
    return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}


def spec_decode_summary(counts: dict) -> dict:
    """Speculative decoding figures from counts (``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``, as :attr:`EngineMetrics.spec_totals`).

    Returns:
        the counts, plus ``acceptance_rate`` (accepted / draft tokens, 0-1),
        ``mean_acceptance_length`` (1 + accepted / drafts: tokens per verifying step) and
        ``acceptance_rate_per_pos`` (accepted at position i / drafts); None without drafts.
    """
    drafts, tokens, accepted = counts["num_drafts"], counts["num_draft_tokens"], counts["num_accepted_tokens"]
    return {**{k: (list(v) if isinstance(v, list) else v) for k, v in counts.items()},
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_pos": [n / drafts for n in counts["num_accepted_tokens_per_pos"]] if drafts else None}


def _spec_log_text(stats: dict) -> str:
    if not stats.get("spec_decode_num_drafts"):
        return ""
    per_pos = ", ".join(f"{r:.3f}" for r in stats["spec_decode_acceptance_rate_per_pos"])
    return (f", Spec decode: acceptance rate {100 * stats['spec_decode_acceptance_rate']:.1f}%, "
            f"mean acceptance length {stats['spec_decode_mean_acceptance_length']:.2f}, "
            f"accepted {stats['spec_decode_num_accepted_tokens']}/{stats['spec_decode_num_draft_tokens']} tokens, "
            f"per-position acceptance rate {per_pos}")


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (NumPy's default); None if empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


class _WithoutCreated:
    """A registry view without the ``*_created`` series: they are timestamps, not
    measurements, and clutter the exposition (vLLM leaves them out too). Filtered here
    rather than with ``prometheus_client.disable_created_metrics()``, which is process-wide."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for metric in self.registry.collect():  # fresh Metric objects on every collect
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric
