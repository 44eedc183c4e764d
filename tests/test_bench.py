"""The bench's pure parts with fakes, and each scenario once through the real engine (tiny sizes)."""

from __future__ import annotations

import dataclasses

import inspect
import json
import sys
import time
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from refengine.bench import bench
from refengine.bench.driver import RequestResult, RunResult, latency_summary, run_engine
from refengine.bench.hf_baseline import compare, run_transformers
from refengine.bench.plot import plot_report
from refengine.bench.report import format_table
from refengine.bench.scenarios import BenchContext, llm_kwargs, run_long_context, run_simple, run_sweep
from refengine.bench.sweep import concurrency_levels, find_knee, sweep_table
from refengine.bench.workload import BenchRequest, load_corpus, parse_len_range, sample_requests
from refengine.cli import engine_options
from refengine.engine_args import EngineArgs
from refengine.engine import LLMEngine
from refengine.metrics import EngineMetrics, RequestMetrics


# --- fakes ------------------------------------------------------------------------------


class FakeEngine:
    """Every running request prefills in its first step and then makes one token per step."""

    def __init__(self):
        self.metrics = EngineMetrics()
        self.running: dict[str, dict] = {}
        self.max_in_flight = 0

    def add_request(self, request_id, prompt_token_ids, sampling_params):
        assert request_id not in self.running
        self.running[request_id] = {"m": RequestMetrics(time.monotonic(), len(prompt_token_ids)),
                                    "max": sampling_params.max_tokens, "tokens": [], "prompt": prompt_token_ids}
        self.max_in_flight = max(self.max_in_flight, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        t0 = time.monotonic()
        prefill = sum(len(r["prompt"]) for r in self.running.values() if not r["tokens"])
        decode = sum(1 for r in self.running.values() if r["tokens"])
        time.sleep(0.001 * (1 + len(self.running)))  # bigger batches take longer
        now = time.monotonic()
        outs = []
        for rid, r in list(self.running.items()):
            r["m"].on_scheduled(t0)
            r["tokens"].append((sum(r["prompt"]) + len(r["tokens"])) % 97)
            r["m"].on_token(now)
            done = len(r["tokens"]) >= r["max"]
            if done:
                r["m"].on_finished(now)
                del self.running[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=done, metrics=r["m"],
                                        outputs=[SimpleNamespace(token_ids=list(r["tokens"]))]))
        self.metrics.record_step(step_start=t0, step_duration=now - t0, num_prefill_tokens=prefill,
                                 num_decode_tokens=decode, num_seqs=len(outs), num_running=len(self.running),
                                 num_waiting=0, kv_cache_usage=0.1, num_preemptions=0)
        return outs


class FakeLLM:
    def __init__(self, engine_kwargs: dict):
        self.engine_kwargs = engine_kwargs
        self.llm_engine = FakeEngine()

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: [ord(c) % 500 for c in text])


# --- workload ---------------------------------------------------------------------------


def test_parse_len_range():
    assert parse_len_range("128") == (128, 128)
    assert parse_len_range("16-512") == (16, 512)
    assert parse_len_range(7) == (7, 7)
    for bad in ("0", "9-3", "a-b", "", "-5"):
        with pytest.raises(ValueError):
            parse_len_range(bad)


def test_corpus_is_real_text():
    text = load_corpus()
    assert len(text) > 20_000
    assert "Beautiful is better than ugly." in text and "White Rabbit" in text


def test_sample_requests_seeded_lengths_and_windows():
    corpus = list(range(1000))
    a = sample_requests(corpus, 50, (16, 512), (4, 8), seed=3)
    b = sample_requests(corpus, 50, (16, 512), (4, 8), seed=3)
    c = sample_requests(corpus, 50, (16, 512), (4, 8), seed=4)
    assert [(r.prompt_token_ids, r.output_len) for r in a] == [(r.prompt_token_ids, r.output_len) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert all(16 <= len(r.prompt_token_ids) <= 512 and 4 <= r.output_len <= 8 for r in a)
    assert len({len(r.prompt_token_ids) for r in a}) > 10  # lengths vary
    for r in a:  # each prompt is a contiguous (wrapping) window of the corpus
        start = r.prompt_token_ids[0]
        assert r.prompt_token_ids == [(start + i) % 1000 for i in range(len(r.prompt_token_ids))]
    assert len({r.request_id for r in a}) == 50


def test_sample_requests_longer_than_corpus_wraps():
    (r,) = sample_requests([5, 6, 7], 1, (10, 10), (1, 1), seed=0)
    assert len(r.prompt_token_ids) == 10 and set(r.prompt_token_ids) == {5, 6, 7}


# --- summaries, knee --------------------------------------------------------------------


def test_latency_summary_in_ms():
    s = latency_summary([0.1, 0.2, 0.3, None, 0.4])
    assert s["mean_ms"] == pytest.approx(250.0)
    assert s["median_ms"] == pytest.approx(250.0)
    assert s["p99_ms"] == pytest.approx(397.0)
    assert s["min_ms"] == pytest.approx(100.0) and s["max_ms"] == pytest.approx(400.0)
    assert latency_summary([None])["p50_ms"] is None


def make_run(label, concurrency, elapsed, ttfts, itls_per_request, prompt=10):
    reqs = []
    for i, (ttft, itls) in enumerate(zip(ttfts, itls_per_request)):
        tpot = sum(itls) / len(itls) if itls else None
        reqs.append(RequestResult(f"r{i}", prompt, len(itls) + 1, len(itls) + 1, ttft, tpot,
                                  ttft + sum(itls), 0.0, list(itls)))
    return RunResult(label, concurrency, elapsed, reqs)


def test_run_result_figures():
    run = make_run("x", 2, 2.0, [0.1, 0.3], [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2]])
    s = run.summary()
    assert s["total_output_tokens"] == 8 and s["total_prompt_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["latency"]["ttft"]["median_ms"] == pytest.approx(200.0)
    assert s["latency"]["tpot"]["mean_ms"] == pytest.approx(150.0)
    assert s["latency"]["itl"]["median_ms"] == pytest.approx(150.0)
    json.dumps(run.to_dict())


def test_find_knee_on_made_up_curves():
    c = [1, 2, 4, 8, 16, 32]
    # Saturating throughput: gains 90 %, 60 %, 30 %, 5 %, 1 %; latency climbs all along.
    thr = [100, 190, 304, 395, 415, 419]
    lat = [10, 10.5, 13, 20, 38, 76]
    assert find_knee(c, thr, lat) == 8
    assert find_knee(c, thr, lat, min_gain=0.35) == 4
    # Linear scaling: no knee.
    assert find_knee(c, [100 * x for x in c], lat) is None
    # Flat throughput but latency not climbing is not a knee; the later climb is.
    assert find_knee([1, 2, 4], [100, 101, 102], [10, 10, 12]) == 2
    # Throughput falling while latency climbs is a knee.
    assert find_knee([1, 2, 4], [100, 150, 140], [10, 11, 30]) == 2
    with pytest.raises(ValueError):
        find_knee([1, 2], [1.0], [1.0, 2.0])


def test_sweep_table_finds_knee():
    runs = [make_run(f"c{c}", c, elapsed, [0.1] * 4, [[itl] * 9] * 4)
            for c, elapsed, itl in [(1, 4.0, 0.01), (2, 2.2, 0.011), (4, 2.1, 0.02), (8, 2.05, 0.04)]]
    t = sweep_table(runs)
    assert t["concurrency"] == [1, 2, 4, 8]
    assert t["output_throughput"][0] == pytest.approx(40 / 4.0)
    assert t["knee_concurrency"] == 2
    assert t["median_tpot_ms"] == pytest.approx([10.0, 11.0, 20.0, 40.0])


def test_concurrency_levels():
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(8) == [1, 2, 4, 8]
    assert concurrency_levels(12) == [1, 2, 4, 8, 12]


def test_format_table():
    t = format_table(["a", "bb"], [[1, 2.345], ["x", None]])
    assert t.splitlines() == ["a    bb", "-  ----", "1  2.35", "x     -"]


# --- the driver with a fake engine --------------------------------------------------------


def test_run_engine_respects_max_concurrency():
    engine = FakeEngine()
    reqs = sample_requests(list(range(300)), 7, (3, 9), (2, 5), seed=1)
    run = run_engine(engine, reqs, max_concurrency=3, progress=False)
    assert engine.max_in_flight == 3
    assert [r.request_id for r in run.requests] == [r.request_id for r in reqs]
    assert [r.output_len for r in run.requests] == [r.output_len for r in reqs]
    assert all(r.ttft is not None and r.e2e_latency >= r.ttft for r in run.requests)
    assert run.steps and sum(s.num_prefill_tokens for s in run.steps) == sum(len(r.prompt_token_ids) for r in reqs)
    engine2 = FakeEngine()
    run_engine(engine2, reqs, max_concurrency=None, progress=False)
    assert engine2.max_in_flight == 7


def test_run_engine_detects_lost_requests():
    class Lossy(FakeEngine):
        def step(self):
            self.running.clear()
            return []

    with pytest.raises(RuntimeError, match="never came back"):
        run_engine(Lossy(), sample_requests([1, 2, 3], 2, (2, 2), (2, 2), seed=0), progress=False)


def bench_engine_kwargs(command: str = "chat", **overrides) -> dict:
    """The engine kwargs a bench command makes from its flags' defaults, then ``overrides``."""
    cmd = bench.commands[command]
    ctx = click.Context(cmd)
    flags = {p.name: p.get_default(ctx) for p in cmd.params}
    return {**dataclasses.asdict(EngineArgs.from_cli(flags)), **overrides}


def test_bench_takes_the_engine_flags_and_defaults_of_generate():
    flags = {p.name for p in engine_options(click.Command("x")).params}
    for name, cmd in bench.commands.items():
        if name != "serve":  # bench serve loads an HTTP server, not an engine of its own
            assert flags <= {p.name for p in cmd.params}, name
    kw = bench_engine_kwargs()
    assert kw == dataclasses.asdict(EngineArgs())  # every default is the engine's own
    assert kw["max_num_seqs"] == 256 and kw["max_num_batched_tokens"] is None


def test_llm_kwargs_budget_without_chunking():
    base = bench_engine_kwargs(max_model_len=1040, enable_chunked_prefill=False)
    assert llm_kwargs({**base, "max_num_batched_tokens": 512})["max_num_batched_tokens"] == 1040
    assert llm_kwargs({**base, "max_num_batched_tokens": 4096})["max_num_batched_tokens"] == 4096
    assert llm_kwargs(base)["max_num_batched_tokens"] is None  # unset: the engine picks one that fits
    chunked = {**base, "enable_chunked_prefill": True, "max_num_batched_tokens": 512}
    assert llm_kwargs(chunked) == chunked


def fake_ctx(tmp_path, **kw) -> BenchContext:
    # an explicit token budget, so the long-context test sees it raised without chunking
    opts = dict(engine_kwargs=bench_engine_kwargs(model="unused", max_num_batched_tokens=512), num_prompts=4,
                input_len=(4, 8), output_len=(3, 5),
                max_concurrency=None, seed=0, json_path=str(tmp_path / "r.json"),
                plot_path=str(tmp_path / "r.png"), trace_path=None, data_dir=None, progress=False,
                echo=lambda s: None)
    opts.update(kw)
    return BenchContext(**opts)


def test_simple_scenario_writes_json_and_plot(tmp_path):
    report = run_simple(fake_ctx(tmp_path, max_concurrency=2), "chat", llm_factory=FakeLLM)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["scenario"] == "chat" and doc["workload"]["max_concurrency"] == 2
    assert doc["engine_settings"][0]["max_num_seqs"] >= 2
    (run,) = doc["runs"]
    assert run["num_requests"] == 4 and len(run["requests"]) == 4 and run["steps"]
    assert run["latency"]["ttft"]["p99_ms"] is not None
    assert report["runs"][0]["output_throughput"] > 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_context_runs_both_modes(tmp_path):
    seen = []

    def factory(engine_kwargs):
        seen.append(dict(engine_kwargs))
        return FakeLLM(engine_kwargs)

    doc = run_long_context(fake_ctx(tmp_path, max_concurrency=2), llm_factory=factory)
    assert [s["enable_chunked_prefill"] for s in seen] == [True, False]
    assert seen[1]["max_num_batched_tokens"] >= seen[1]["max_model_len"]  # whole prompt fits a step
    assert [r["label"] for r in doc["runs"]] == ["refengine chunked_prefill=on", "refengine chunked_prefill=off"]


def test_sweep_scenario(tmp_path):
    lines = []
    doc = run_sweep(fake_ctx(tmp_path, num_prompts=8, max_concurrency=4, echo=lines.append),
                          "tpot", 0.10, llm_factory=FakeLLM)
    assert doc["sweep"]["concurrency"] == [1, 2, 4]
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2, 4]
    assert "knee_concurrency" in doc["sweep"] and any("knee" in line for line in lines)
    assert (tmp_path / "r.png").exists()


def test_cli_help_and_bad_length():
    runner = CliRunner()
    res = runner.invoke(bench, ["--help"])
    assert res.exit_code == 0
    for name in ("throughput", "chat", "generation", "long-context", "sweep"):
        assert name in res.output
    res = runner.invoke(bench, ["throughput", "--model", ".", "--input-len", "9-3"])
    assert res.exit_code != 0 and "LO <= HI" in res.output
    res = runner.invoke(bench, ["chat", "--model", "/nonexistent/model"])
    assert res.exit_code != 0 and "'/nonexistent/model' does not exist" in res.output


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    """No matplotlib: --plot fails before any work with one line naming the extra; so does plot_report."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    res = CliRunner().invoke(bench, ["chat", "--model", str(tmp_path), "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert res.output == "Error: plotting needs matplotlib, which is not installed: pip install 'refengine[plot]'\n"
    with pytest.raises(ImportError, match=r"pip install 'refengine\[plot\]'"):
        plot_report(tmp_path / "p.png", [])
    assert not (tmp_path / "p.png").exists()


def test_cli_bad_engine_setting_is_one_line(tiny_llama_dir):
    """An engine setting the engine refuses ends the command with its message, as in `generate`."""
    res = CliRunner().invoke(bench, ["chat", "--model", str(tiny_llama_dir), "--dtype", "float16", "--disable-tqdm"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit)
    assert res.output.strip().splitlines()[-1].startswith("Error: --dtype='float16' is not supported on the CPU")


# --- transformers comparison on a tiny random model ------------------------------------------


def test_run_transformers_on_tiny_model(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   eos_token_id=1, pad_token_id=None, bos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    reqs = [BenchRequest("a", [3, 4, 5, 6, 7], 4), BenchRequest("b", [8, 9], 2), BenchRequest("c", [10, 11, 12], 3)]
    run = run_transformers(str(tmp_path), reqs, batch_size=2, progress=False)
    assert [r.output_len for r in run.requests] == [4, 2, 3]
    assert [len(r.output_token_ids) for r in run.requests] == [4, 2, 3]
    for r in run.requests:
        assert r.ttft is not None and r.e2e_latency >= r.ttft and len(r.inter_token_latencies) == r.output_len - 1
    # Left padding must not change a row's greedy continuation: "b" alone gives the same tokens.
    alone = run_transformers(str(tmp_path), [reqs[1]], batch_size=1, progress=False)
    assert alone.requests[0].output_token_ids == run.requests[1].output_token_ids
    cmp = compare(run, run)
    assert cmp["output_throughput_ratio"] == pytest.approx(1.0) and cmp["greedy_exact_match"] == 3


# --- each scenario through the real engine, tiny ------------------------------------------

TINY = ["--num-prompts", "2", "--input-len", "4-6", "--output-len", "2", "--disable-tqdm", "--no-warmup"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,extra", [
    ("throughput", []),
    ("chat", ["--max-concurrency", "2"]),
    ("generation", []),
    ("long-context", ["--max-concurrency", "2", "--max-num-batched-tokens", "4", "--num-prompts", "1"]),
    ("sweep", ["--max-concurrency", "2"]),
])
def test_scenario_smoke_real_engine(tmp_path, smollm2_dir, scenario, extra):
    """Each scenario end to end through the real engine and model, 2 requests of 2 tokens."""
    out = tmp_path / "r.json"
    args = [scenario, *TINY, "--model", str(smollm2_dir), *extra, "--json", str(out)]
    if scenario == "sweep":
        args += ["--plot", str(tmp_path / "r.png"), "--trace", str(tmp_path / "t.json")]
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    n = doc["workload"]["num_prompts"]
    for run in doc["runs"]:
        assert run["num_requests"] == n
        assert [r["output_len"] for r in run["requests"]] == [2] * n  # ignore_eos: exactly as asked
        assert run["output_throughput"] > 0 and run["steps"]
    if scenario == "throughput":  # the engine's own defaults, as the engine resolved them
        (settings,) = doc["engine_settings"]
        assert settings["max_num_seqs"] == 256 and settings["max_num_batched_tokens"] is None
        assert settings["resolved_config"]["max_num_batched_tokens"] == 2048
        assert settings["max_model_len"] == settings["resolved_config"]["max_model_len"] == 16  # 6 + 2, one block
    if scenario == "long-context":
        on, off = doc["runs"]
        assert max(s["num_prefill_tokens"] for s in on["steps"]) <= 4  # chunked to the budget
        assert max(s["num_prefill_tokens"] for s in off["steps"]) >= 4
        # without chunking the explicit budget is raised to max_model_len
        assert [s["resolved_config"]["max_num_batched_tokens"] for s in doc["engine_settings"]] == [4, 16]
    if scenario == "sweep":
        assert doc["sweep"]["concurrency"] == [1, 2]
        assert (tmp_path / "r.png").exists() and json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def load_benchmark_script(name: str):
    """``benchmarks/NAME.py`` as a module (the scripts are not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_single_smoke(tmp_path, smollm2_dir):
    """benchmarks/bench_single.py at tiny sizes: both engines run and agree on greedy tokens."""
    mod = load_benchmark_script("bench_single")
    out = tmp_path / "single.json"
    res = CliRunner().invoke(mod.main, ["--model", str(smollm2_dir), "--prompt-len", "8", "--decode-steps", "2",
                                        "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    assert doc["refengine"]["prefill_s"] > 0 and doc["transformers"]["decode_tok_per_s"] > 0
    assert len(doc["refengine"]["token_ids"]) == 3 and doc["greedy_matching_prefix"] == 3


@pytest.mark.slow
def test_bench_spec_smoke(tmp_path, smollm2_dir):
    """benchmarks/bench_spec.py at tiny sizes: both sides run, the outputs agree, every figure is there."""
    mod = load_benchmark_script("bench_spec")
    out = tmp_path / "spec.json"
    res = CliRunner().invoke(mod.main, ["--model", str(smollm2_dir), "--max-tokens", "6", "--runs", "2",
                                        "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    for name in ("grounded", "free"):
        w = doc["workloads"][name]
        assert w["identical_outputs"] is True
        assert len(w["off"]["decode_tok_per_s_all"]) == len(w["on"]["decode_tok_per_s_all"]) == 2
        assert w["off"]["num_tokens"] == w["on"]["num_tokens"] == 6
    assert sorted(int(n) for n in doc["forward_s_by_rows"]) == [1, 2, 4, 6, 8]
