"""Metrics arithmetic on a scripted clock, and the Prometheus text parsed back."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from refengine.metrics import EngineMetrics, RequestMetrics, percentile, token_count_buckets


def scripted_request() -> RequestMetrics:
    """Arrives at 10.0, scheduled at 10.5, tokens at 11.0, 11.25, 11.75, 12.0, finished at 12.0."""
    m = RequestMetrics(arrival_time=10.0, num_prompt_tokens=7)
    m.on_scheduled(10.5)
    for t in (11.0, 11.25, 11.75, 12.0):
        m.on_token(t)
    m.on_finished(12.0)
    return m


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition as {(name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


# --- RequestMetrics ---------------------------------------------------------------------


def test_request_metrics_derived_values():
    m = scripted_request()
    assert m.num_output_tokens == 4
    assert m.ttft == pytest.approx(1.0)
    assert m.inter_token_latencies == pytest.approx([0.25, 0.5, 0.25])
    assert m.tpot == pytest.approx((0.25 + 0.5 + 0.25) / 3)
    assert m.e2e_latency == pytest.approx(2.0)
    assert m.queue_time == pytest.approx(0.5)
    assert m.prefill_time == pytest.approx(0.5)
    assert m.decode_time == pytest.approx(1.0)
    # The phases add up to the whole.
    assert m.queue_time + m.prefill_time + m.decode_time == pytest.approx(m.e2e_latency)


def test_request_metrics_undefined_values_are_none():
    m = RequestMetrics(arrival_time=1.0)
    assert (m.ttft, m.tpot, m.e2e_latency, m.queue_time, m.prefill_time, m.decode_time) == (None,) * 6
    assert m.inter_token_latencies == []
    m.on_scheduled(2.0)
    m.on_token(3.0)
    assert m.ttft == 2.0
    assert m.tpot is None  # one token: no inter-token latency yet
    assert m.inter_token_latencies == []


def test_first_stamp_wins_for_scheduled_and_finished():
    m = RequestMetrics(arrival_time=0.0)
    m.on_scheduled(1.0)
    m.on_scheduled(5.0)  # rescheduled after preemption
    m.on_token(2.0)
    m.on_finished(3.0)
    m.on_finished(4.0)
    assert m.first_scheduled_time == 1.0
    assert m.finished_time == 3.0


def test_summary_is_json_ready():
    d = scripted_request().summary()
    json.dumps(d)
    assert d["ttft"] == pytest.approx(1.0) and d["num_output_tokens"] == 4


# --- EngineMetrics: Prometheus ----------------------------------------------------------


def feed(em: EngineMetrics) -> None:
    """Two steps, three TTFTs / ITLs, two finished requests."""
    em.record_step(step_start=0.0, step_duration=0.2, num_prefill_tokens=100, num_decode_tokens=0,
                   num_seqs=2, num_running=2, num_waiting=3, kv_cache_usage=0.25, num_preemptions=0,
                   num_generated_tokens=2)
    em.record_step(step_start=0.2, step_duration=0.05, num_prefill_tokens=30, num_decode_tokens=2,
                   num_seqs=3, num_running=3, num_waiting=1, kv_cache_usage=0.5, num_preemptions=2)
    for ttft in (0.2, 0.25, 3.0):
        em.record_first_token(ttft)
    for itl in (0.05, 0.05, 0.3):
        em.record_token_latency(itl)
    em.record_finished(scripted_request(), "length", "a")
    em.record_finished(scripted_request(), "stop", "b")


def test_exposition_names_types_and_values():
    em = EngineMetrics()
    feed(em)
    text = em.exposition()
    fam = families(text)
    expected_types = {
        "refengine:prompt_tokens": "counter",
        "refengine:generation_tokens": "counter",
        "refengine:request_success": "counter",
        "refengine:num_preemptions": "counter",
        "refengine:num_requests_running": "gauge",
        "refengine:num_requests_waiting": "gauge",
        "refengine:kv_cache_usage_perc": "gauge",
        "refengine:time_to_first_token_seconds": "histogram",
        "refengine:inter_token_latency_seconds": "histogram",
        "refengine:e2e_request_latency_seconds": "histogram",
        "refengine:request_time_per_output_token_seconds": "histogram",
        "refengine:request_prompt_tokens": "histogram",
        "refengine:request_generation_tokens": "histogram",
    }
    for name, typ in expected_types.items():
        assert fam.get(name) == typ, (name, fam.get(name))
    assert not [n for n in fam if n.endswith("_created")]

    s = samples(text)
    # Counters come out with exactly one `_total`.
    assert s[("refengine:prompt_tokens_total", ())] == 130
    assert s[("refengine:generation_tokens_total", ())] == 2 + 2  # explicit 2, then default = decode tokens
    assert s[("refengine:num_preemptions_total", ())] == 2
    assert s[("refengine:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("refengine:request_success_total", (("finished_reason", "stop"),))] == 1
    assert "_total_total" not in text
    # Gauges hold the last step.
    assert s[("refengine:num_requests_running", ())] == 3
    assert s[("refengine:num_requests_waiting", ())] == 1
    assert s[("refengine:kv_cache_usage_perc", ())] == 0.5
    # Histograms: counts, sums and cumulative buckets.
    assert s[("refengine:time_to_first_token_seconds_count", ())] == 3
    assert s[("refengine:time_to_first_token_seconds_sum", ())] == pytest.approx(3.45)
    assert s[("refengine:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 2
    assert s[("refengine:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 3
    assert s[("refengine:inter_token_latency_seconds_count", ())] == 3
    assert s[("refengine:inter_token_latency_seconds_sum", ())] == pytest.approx(0.4)
    assert s[("refengine:e2e_request_latency_seconds_count", ())] == 2
    assert s[("refengine:e2e_request_latency_seconds_sum", ())] == pytest.approx(4.0)
    assert s[("refengine:request_prompt_tokens_sum", ())] == 14
    assert s[("refengine:request_generation_tokens_sum", ())] == 8
    assert s[("refengine:request_queue_time_seconds_sum", ())] == pytest.approx(1.0)
    # TPOT per request: (12.0 - 11.0) / 3 tokens after the first, twice
    assert s[("refengine:request_time_per_output_token_seconds_count", ())] == 2
    assert s[("refengine:request_time_per_output_token_seconds_sum", ())] == pytest.approx(2 / 3)


def test_two_engines_do_not_clash():
    a, b = EngineMetrics(), EngineMetrics()
    feed(a)
    assert samples(b.exposition())[("refengine:prompt_tokens_total", ())] == 0
    assert samples(a.exposition())[("refengine:prompt_tokens_total", ())] == 130


def test_shared_registry_is_used():
    reg = CollectorRegistry()
    em = EngineMetrics(registry=reg)
    em.record_first_token(1.0)
    assert reg.get_sample_value("refengine:time_to_first_token_seconds_count") == 1


# --- EngineMetrics: steps, log line, trace ------------------------------------------------


def test_steps_are_recorded_and_bounded():
    em = EngineMetrics(max_steps=3)
    for i in range(5):
        em.record_step(step_start=float(i), step_duration=0.5, num_prefill_tokens=i, num_decode_tokens=1,
                       num_seqs=1, num_running=1, num_waiting=0, kv_cache_usage=0.1, num_preemptions=0)
    assert [s.start for s in em.steps] == [2.0, 3.0, 4.0]
    assert em.steps[-1].num_batched_tokens == 5
    assert em.steps[-1].num_generated_tokens == 1
    assert em.total_prompt_tokens == 0 + 1 + 2 + 3 + 4  # totals are not bounded


def test_stats_since_last_log_windows():
    now = [100.0]
    em = EngineMetrics(clock=lambda: now[0])
    feed(em)
    now[0] = 102.0
    st = em.stats_since_last_log()
    assert st["prompt_tokens"] == 130 and st["generation_tokens"] == 4
    assert st["interval_s"] == pytest.approx(2.0)
    assert st["prompt_throughput"] == pytest.approx(65.0)
    assert st["generation_throughput"] == pytest.approx(2.0)
    assert st["num_running"] == 3 and st["num_waiting"] == 1
    assert st["kv_cache_usage_perc"] == pytest.approx(50.0)
    assert st["num_preemptions_total"] == 2
    line = EngineMetrics.format_log_line(st)
    assert "65.0 tokens/s" in line and "KV cache usage: 50.0%" in line
    # The window resets; totals do not.
    now[0] = 103.0
    st2 = em.stats_since_last_log()
    assert st2["prompt_tokens"] == 0 and st2["interval_s"] == pytest.approx(1.0)
    assert st2["num_preemptions_total"] == 2


def test_prefix_cache_counters_and_hit_rate():
    now = [10.0]
    em = EngineMetrics(clock=lambda: now[0])
    st = em.stats_since_last_log()
    assert st["prefix_cache_hit_rate"] == 0.0  # no queries yet
    em.record_step(step_start=0.0, step_duration=0.1, num_prefill_tokens=40, num_decode_tokens=0, num_seqs=2,
                   num_running=2, num_waiting=0, kv_cache_usage=0.1, num_preemptions=0,
                   prefix_cache_queries=100, prefix_cache_hits=60)
    em.record_step(step_start=0.1, step_duration=0.1, num_prefill_tokens=20, num_decode_tokens=2, num_seqs=3,
                   num_running=3, num_waiting=0, kv_cache_usage=0.1, num_preemptions=0,
                   prefix_cache_queries=20, prefix_cache_hits=0)
    text = em.exposition()
    assert "# TYPE refengine:prefix_cache_queries_total counter" in text
    assert "refengine:prefix_cache_queries_total 120.0" in text
    assert "refengine:prefix_cache_hits_total 60.0" in text
    st = em.stats_since_last_log()
    assert (st["prefix_cache_queries"], st["prefix_cache_hits"]) == (120, 60)
    assert st["prefix_cache_hit_rate"] == pytest.approx(50.0)
    assert "Prefix cache hit rate: 50.0%" in EngineMetrics.format_log_line(st)
    assert em.steps[0].prefix_cache_hits == 60
    assert em.stats_since_last_log()["prefix_cache_queries"] == 0  # the window resets
    assert (em.total_prefix_cache_queries, em.total_prefix_cache_hits) == (120, 60)


def test_write_trace(tmp_path):
    em = EngineMetrics(trace=True)
    feed(em)
    path = tmp_path / "trace.json"
    em.write_trace(path)
    doc = json.loads(path.read_text())
    ev = doc["traceEvents"]
    steps = [e for e in ev if e.get("cat") == "step"]
    assert [e["name"] for e in steps] == ["prefill", "prefill+decode"]
    assert steps[0]["ts"] == 0 and steps[0]["dur"] == pytest.approx(200_000)  # microseconds
    assert steps[1]["ts"] == pytest.approx(200_000) and steps[1]["args"]["num_decode_tokens"] == 2
    spans = [e for e in ev if e.get("cat") == "request"]
    assert {e["name"] for e in spans} == {"queue", "prefill", "decode"}
    assert len(spans) == 6  # two requests x three phases
    names = {e["args"]["name"] for e in ev if e.get("name") == "thread_name" and e["pid"] == 2}
    assert names == {"a", "b"}
    for e in ev:  # every event has the fields Chrome's viewer needs
        assert "ph" in e and "pid" in e and "name" in e


def test_write_trace_needs_trace_flag(tmp_path):
    with pytest.raises(RuntimeError, match="trace=True"):
        EngineMetrics().write_trace(tmp_path / "t.json")


# --- helpers --------------------------------------------------------------------------------


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0


def test_token_count_buckets():
    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
