"""The bench's pure parts with fakes, and each scenario once through the real engine (tiny sizes)."""

from __future__ import annotations

import dataclasses

import json
import pathlib
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
from refengine.bench import report as bench_report
from refengine.bench.report import command_line, format_table, markdown_table, replace_section, write_performance
from refengine.bench.scenarios import BenchContext, llm_kwargs, run_long_context, run_simple, run_sweep
from refengine.bench.sweep import concurrency_levels, find_knee, sweep_table
from refengine.bench.workload import BenchRequest, load_corpus, parse_len_range, sample_requests
from refengine.cli import engine_options
from refengine.engine_args import EngineArgs
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


def test_peers_decode_ratios_pair_rounds():
    """bench peers divides each round's decode rate by llama.cpp's in the same round."""
    from refengine.bench.peers import decode_ratios

    case = [{"decode_tok_s": 200.0}, {"decode_tok_s": 120.0}, {"decode_tok_s": 210.0}]
    base = [{"decode_tok_s": 100.0}, {"decode_tok_s": 80.0}, {"decode_tok_s": 140.0}]
    assert decode_ratios(case, base) == [2.0, 1.5, 1.5]


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
        # bench serve loads an HTTP server, not an engine of its own; bench kernels times bare
        # models; bench peers runs fixed settings per engine, beside llama.cpp and CTranslate2
        if name not in ("serve", "kernels", "peers"):
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

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
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
    """refengine bench spec at tiny sizes: both sides run, the outputs agree, every figure is there."""
    out = tmp_path / "spec.json"
    # a context of 160 holds every prompt with its tokens and proposals (up to ~125), and bounds
    # the prefill that each of the command's three engines runs to warm up (the default, 300 rows)
    res = CliRunner().invoke(bench, ["spec", "--model", str(smollm2_dir), "--max-tokens", "6", "--runs", "2",
                                     "--repeats", "1", "--max-model-len", "160", "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    for name in ("grounded", "free"):
        w = doc["workloads"][name]
        assert w["identical_outputs"] is True
        assert len(w["off"]["decode_tok_per_s_all"]) == len(w["on"]["decode_tok_per_s_all"]) == 2
        assert w["off"]["num_tokens"] == w["on"]["num_tokens"] == 6
    assert sorted(int(n) for n in doc["forward_s_by_rows"]) == [1, 2, 4, 6, 8]


# --- docs/PERFORMANCE.md: the section writer ----------------------------------------------------

FACTS = {"date_utc": "2030-01-02 03:04 UTC", "commit": "abc1234 + uncommitted changes", "cpu": "Test CPU 9000",
         "cpu_count": 4, "threads": 2, "read_bandwidth_bytes_per_s": 13.9e9, "float32_flops_per_s": 150e9}


@pytest.fixture
def fixed_machine(monkeypatch):
    """The machine facts fixed (no probes, no git), so a section's text is known."""
    monkeypatch.setattr(bench_report, "machine_facts", lambda limits=None: dict(FACTS))


def test_markdown_table():
    assert markdown_table(["a", "b|c"], [[1, 2.345], ["x", None]]).splitlines() == [
        "| a | b\\|c |", "|---|---|", "| 1 | 2.35 |", "| x | - |"]


def test_performance_section_created_replaced_and_others_kept(tmp_path, fixed_machine):
    path = tmp_path / "PERFORMANCE.md"
    write_performance(path, "bench alpha", ["First run.", (["x", "tok/s"], [[1, 10.0]])], command="refengine bench alpha")
    text = path.read_text()
    assert text.startswith("# Performance\n\n## bench alpha\n")
    for line in ["- date: 2030-01-02 03:04 UTC", "- commit: abc1234 + uncommitted changes",
                 "- CPU: Test CPU 9000 (2 of 4 cores used)",
                 "- measured in this run: read bandwidth 13.9 GB/s, float32 BLAS 150.0 GFLOP/s",
                 "- command: `refengine bench alpha`", "First run.", "| x | tok/s |", "| 1 | 10.00 |"]:
        assert line in text.splitlines(), line
    # A second title is appended; the first stays byte for byte.
    write_performance(path, "bench beta", [(["y"], [["b"]])], command="refengine bench beta")
    two = path.read_text()
    assert two.startswith(text.rstrip("\n") + "\n\n## bench beta\n") and "| b |" in two
    # Hand-written text around it survives a replacement of the first section.
    path.write_text("# Performance\n\nIntro.\n\n## Carried over\n\n### old\n\n| old |\n|---|\n\n"
                    + two.split("\n", 2)[2])
    before = path.read_text()
    write_performance(path, "bench alpha", [(["x", "tok/s"], [[1, 20.0]])], command="refengine bench alpha --again")
    after = path.read_text()
    assert after.count("## bench alpha") == 1 and "| 1 | 20.00 |" in after and "| 1 | 10.00 |" not in after
    assert "First run." not in after and "`refengine bench alpha --again`" in after
    assert after.split("## bench alpha")[0] == before.split("## bench alpha")[0]  # intro and carried-over kept
    assert after.split("## bench beta")[1] == before.split("## bench beta")[1]  # the later section kept
    assert after.index("## Carried over") < after.index("## bench alpha") < after.index("## bench beta")


def test_replace_section_keeps_subsections_and_fenced_headings():
    doc = "# T\n\n## a\n\n### sub\n\nx\n\n```\n## not a heading\n```\n\n## b\n\nkeep\n"
    new = replace_section(doc, "a", "## a\n\nnew\n")
    assert new == "# T\n\n## a\n\nnew\n\n## b\n\nkeep\n"
    assert replace_section(new, "b", "## b\n\nlast\n") == "# T\n\n## a\n\nnew\n\n## b\n\nlast\n"
    assert replace_section("", "c", "## c\n") == "## c\n"
    with pytest.raises(ValueError, match="one non-empty line"):
        write_performance("unused.md", "two\nlines", [], command="x")


def test_performance_section_without_the_flag_writes_nothing(tmp_path, fixed_machine):
    assert write_performance(None, "bench alpha", [], command="x") is None
    run_simple(fake_ctx(tmp_path, plot_path=None), "chat", llm_factory=FakeLLM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    path = tmp_path / "perf.md"
    run_simple(fake_ctx(tmp_path, plot_path=None, performance_md=str(path)), "chat", llm_factory=FakeLLM)
    text = path.read_text()
    assert "## bench chat" in text and "| run | concurrency | requests | output tok/s |" in text
    assert "4 requests, prompts of 4-8 tokens, outputs of 3-5 tokens" in text


def test_command_line_names_no_machine_path(tmp_path):
    root = tmp_path / "checkout"
    (root / "refengine" / "bench").mkdir(parents=True)
    assert command_line([str(root / ".venv" / "bin" / "refengine"), "bench", "chat", "--model",
                         str(root / "weights" / "m"), "--performance-md", str(root / "docs" / "PERFORMANCE.md")],
                        root=root) == ("refengine bench chat --model weights/m --performance-md docs/PERFORMANCE.md")
    assert command_line([str(root / "refengine" / "bench" / "__main__.py"), "forward"], root=root) == \
        "python -m refengine.bench forward"
    assert command_line([str(root / "benchmarks" / "bench_single.py"), "--repeats", "3"], root=root) == \
        "python benchmarks/bench_single.py --repeats 3"


def test_machine_facts_name_the_cpu_and_the_commit():
    from refengine.bench.machine import cpu_model, git_commit, machine_facts

    facts = machine_facts(limits=(1e10, 1e11))
    assert facts["cpu"] == cpu_model() and facts["cpu"] and facts["threads"] >= 1
    assert facts["read_bandwidth_bytes_per_s"] == 1e10 and facts["float32_flops_per_s"] == 1e11
    commit = git_commit()
    assert commit == "not a git checkout" or len(commit.split()[0]) >= 4
    assert git_commit(pathlib.Path(__file__).parent) == "not a git checkout"  # tests/ is not the top of a checkout


@pytest.mark.parametrize("name, expected", [
    ("AMD EPYC", "AMD EPYC (family 25, model 17)"),  # a VM's bare name: the generation added
    ("Intel(R) Xeon(R) Platinum 8488C", "Intel(R) Xeon(R) Platinum 8488C"),  # a model number already
])
def test_cpu_model_adds_family_and_model_to_a_bare_name(monkeypatch, name, expected):
    import builtins
    import io

    from refengine.bench import machine

    text = (f"processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: {name}\n\n"
            "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: other\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO(text) if f == "/proc/cpuinfo"
                        else real_open(f, *a, **k))
    assert machine.cpu_model() == expected


# --- the bench commands that were scripts, tiny ------------------------------------------------


def test_bench_prefix_cache_smoke(tmp_path, tiny_llama_tok_dir, fixed_machine):
    """refengine bench prefix-cache on the tiny model: both sides, both workloads, the same outputs."""
    out, md = tmp_path / "prefix.json", tmp_path / "perf.md"
    res = CliRunner().invoke(bench, ["prefix-cache", "--model", str(tiny_llama_tok_dir), "--prefix-len", "32",
                                     "--suffix-len", "4", "--num-requests", "2", "--output-len", "2", "--distinct-len", "8-16",
                                     "--repeats", "1", "--json", str(out), "--performance-md", str(md)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    assert doc["identical_outputs"] is True
    for side in ("off", "on"):
        for phase in ("cold", "warm"):
            assert doc["shared_prefix"][side][phase]["ttft_median_s"] > 0
        assert len(doc["no_shared_prefix"][side]) == 1
    assert max(doc["shared_prefix"]["on"]["warm"]["num_cached_tokens"]) >= 32  # the prefix came from the cache
    assert doc["shared_prefix"]["off"]["warm"]["num_cached_tokens"] == [0, 0]
    assert "TTFT median off/on" in res.output and "## bench prefix-cache" in md.read_text()


def test_bench_kernels_smoke(tmp_path, tiny_llama_dir, fixed_machine):
    """refengine bench kernels on the tiny model's shapes, one round: every row printed and kept."""
    md = tmp_path / "perf.md"
    res = CliRunner().invoke(bench, ["kernels", "--model", str(tiny_llama_dir), "--repeats", "1",
                                     "--sections", "kernels,linear", "--performance-md", str(md)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "attention decode 8 seqs, ctx 512" in res.output and "lm_head, tiles" in res.output
    text = md.read_text()
    assert "## bench kernels" in text and "| kernels | attention prefill 512 | numpy |" in text
    assert "| linear |" in text
    res = CliRunner().invoke(bench, ["kernels", "--model", str(tiny_llama_dir), "--sections", "kernels,nope"])
    assert res.exit_code == 2 and "nope: the sections are kernels, linear, step" in res.output


def test_bench_import_order_smoke(tmp_path, tiny_llama_tok_dir, fixed_machine):
    """refengine bench import-order at tiny sizes: each case in its own process, ratios to fresh."""
    from refengine.bench.import_order import CASES, available_cases

    out, md = tmp_path / "order.json", tmp_path / "perf.md"
    res = CliRunner().invoke(bench, ["import-order", "--model", str(tiny_llama_tok_dir), "--num-prompts", "2",
                                     "--input-len", "4-8", "--output-len", "2", "--json", str(out),
                                     "--performance-md", str(md)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    ran, skipped = available_cases(list(CASES))
    assert [c["case"] for c in doc["cases"]] == ran and sorted(doc["skipped"]) == sorted(skipped)
    fresh = doc["cases"][0]
    assert fresh["case"] == "fresh" and fresh["ratio_to_fresh"] == pytest.approx(1.0)
    for case in doc["cases"]:
        assert case["output_throughput"] > 0 and len(case["output_throughput_all"]) == 1
        (r,) = doc["runs"][case["case"]]
        assert r["total_output_tokens"] == 4
        assert r["loaded_before_refengine"] == (["torch", "transformers"] if case["case"] == "torch" else [])
    assert "## bench import-order" in md.read_text() and "| fresh | - |" in md.read_text()
