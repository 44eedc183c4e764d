"""``refengine bench --breakdown`` (where a step's time goes) and ``refengine bench forward``
(one pass per row count against the roofline), on the tiny random model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from refengine import LLM, SamplingParams
from refengine.bench import bench
from refengine.bench.breakdown import PARTS, StepBreakdown, format_breakdown
from refengine.bench.forward import measure_bandwidth, measure_compute, pass_cost


def test_breakdown_accounts_for_every_step_and_restores_the_engine(tiny_llama_tok_dir):
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, log_stats=False)
    engine = llm.llm_engine
    ops, step, sampler = engine.model.ops, engine.step, engine.sampler
    steps_before = len(engine.metrics.steps)
    with StepBreakdown(engine) as timer:
        outs = llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                           ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    records = list(engine.metrics.steps)[steps_before:]
    summary = timer.summary()
    # one prefill step (both prompts fit the budget), then three decode steps
    assert summary["prefill"]["num_steps"] == sum(1 for r in records if r.num_prefill_tokens) == 1
    assert summary["decode"]["num_steps"] == sum(1 for r in records if not r.num_prefill_tokens) == 3
    for kind in ("prefill", "decode"):
        parts = summary[kind]["parts"]
        assert set(parts) == set(PARTS)
        for part in ("matmul", "lm_head", "attention", "elementwise", "sampler"):
            assert parts[part]["ms_per_step"] > 0, (kind, part)
        # the rest is what the timed parts leave of the step: the shares add up to one
        assert sum(p["ms_per_step"] for p in parts.values()) == pytest.approx(summary[kind]["step_ms_mean"])
        assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
    table = format_breakdown(summary)
    assert "3 decode steps, 1 prefill steps" in table and "lm_head" in table
    # nothing of the timers is left behind
    assert engine.model.ops is ops and engine.step == step and engine.sampler is sampler
    assert "step" not in vars(engine)
    assert not {"prepare", "write_kv", "forward"} & set(vars(engine.model.attention))


def test_pass_cost_counts_weights_kv_and_flops(tiny_llama_tok_dir):
    llm = LLM(model=str(tiny_llama_tok_dir), max_model_len=64, log_stats=False)
    model = llm.llm_engine.model
    # the tiny model: hidden 128, intermediate 96, 3 layers, 4 heads / 2 KV heads of 32, vocab 211, tied
    hidden, inter, layers, heads, kv_heads, hd, vocab = 128, 96, 3, 4, 2, 32, 211
    matrix = hidden * (heads + 2 * kv_heads) * hd + heads * hd * hidden + hidden * 2 * inter + inter * hidden
    weights = 4 * layers * (matrix + 2 * hidden)  # float32 matrices and the two norms per layer
    head = 4 * vocab * hidden
    kv_token = 2 * layers * kv_heads * hd * 4
    nbytes, flops = pass_cost(model, rows=2, context_len=8, decode=True)
    assert nbytes == weights + head + 4 * hidden + 2 * hidden * 4 + 2 * 8 * kv_token
    assert flops == 2 * 2 * layers * matrix + 2 * 2 * vocab * hidden + 4 * 2 * 8 * layers * heads * hd
    nbytes, flops = pass_cost(model, rows=16, context_len=0, decode=False)  # prefill: causal, one logit row
    assert nbytes == weights + head + 4 * hidden + 16 * hidden * 4 + 16 * kv_token
    assert flops == 2 * 16 * layers * matrix + 2 * vocab * hidden + 2 * 16 * 17 * layers * heads * hd


def test_machine_limits_are_plausible():
    assert 1e8 < measure_bandwidth(nbytes=16 << 20, repeats=2) < 1e13  # 0.1 GB/s .. 10 TB/s
    assert 1e8 < measure_compute(n=256, repeats=2) < 1e14


def test_forward_command_table_and_json(tiny_llama_tok_dir, tmp_path):
    out = tmp_path / "f.json"
    res = CliRunner().invoke(bench, ["forward", "--model", str(tiny_llama_tok_dir), "--rows", "1,2,40",
                                     "--context-len", "20", "--decode-max-rows", "16", "--repeats", "2",
                                     "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "memory read bandwidth" in res.output and "of roofline" in res.output
    doc = json.loads(out.read_text())
    assert [(p["rows"], p["kind"]) for p in doc["passes"]] == [(1, "decode"), (2, "decode"), (40, "prefill")]
    for p in doc["passes"]:
        assert p["ms"] > 0 and p["roofline_ms"] > 0 and p["tokens_per_s"] == pytest.approx(1e3 * p["rows"] / p["ms"])
        assert sum(p["parts_ms"].values()) == pytest.approx(p["ms"], rel=1e-6)
    assert doc["engine_settings"]["max_model_len"] == 40  # the longest pass: the 40-row prefill


@pytest.mark.parametrize("rows,message", [("1,x", "not a comma-separated list"), ("0,2", "each >= 1")])
def test_forward_command_bad_rows(tiny_llama_tok_dir, rows, message):
    res = CliRunner().invoke(bench, ["forward", "--model", str(tiny_llama_tok_dir), "--rows", rows])
    assert res.exit_code == 2 and message in res.output


def test_forward_command_too_short_max_model_len(tiny_llama_tok_dir):
    res = CliRunner().invoke(bench, ["forward", "--model", str(tiny_llama_tok_dir), "--rows", "1",
                                     "--context-len", "30", "--max-model-len", "16"])
    assert res.exit_code == 2
    assert "--max-model-len=16 is shorter than the longest pass (31 tokens" in res.output


def test_breakdown_flag_prints_table_and_writes_json(tiny_llama_tok_dir, tmp_path):
    out = tmp_path / "c.json"
    res = CliRunner().invoke(bench, ["chat", "--model", str(tiny_llama_tok_dir), "--num-prompts", "2",
                                     "--input-len", "4", "--output-len", "3", "--max-concurrency", "2",
                                     "--disable-tqdm", "--no-warmup", "--breakdown", "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "where a step's time goes" in res.output
    (entry,) = json.loads(out.read_text())["step_breakdown"]
    assert entry["run"] == "refengine"
    assert entry["decode"]["num_steps"] >= 2 and entry["prefill"]["num_steps"] >= 1
    assert np.isclose(sum(p["share"] for p in entry["decode"]["parts"].values()), 1.0)
