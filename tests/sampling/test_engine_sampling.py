"""Sampling, stopping and streaming through the whole engine, on the real model."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from refengine import LLM, SamplingParams
from refengine.cli import main

PROMPT = "The capital of France is"
# transformers' greedy continuation of PROMPT (see test_golden_smollm2.py): " Paris.\n\nThe answer is: 2018-..."
PARIS, DOT, NEWLINE = 7042, 30, 198


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=smollm2_dir, block_size=16, log_stats=False)


def run_streaming(llm, prompts, params):
    """Drive the engine step by step; return {id: (final output, joined deltas)}."""
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", p, sp)
    deltas, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id] = deltas.get(out.request_id, "") + out.outputs[0].delta_text
            if out.finished:
                final[out.request_id] = out
    return {rid: (final[rid], deltas[rid]) for rid in final}


def test_seeded_sampling_ignores_batch_company_and_position(llm):
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], sampled, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5)]
    batch = llm.generate(["Once upon a time", PROMPT, "def fibonacci(n):", PROMPT],
                         [others[0], sampled, others[1], sampled], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids == alone
    assert len(alone) == 24


def test_seeded_sampling_survives_preemption(smollm2_dir, llm):
    sampled = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], sampled, use_tqdm=False)[0].outputs[0].token_ids
    small = LLM(model=smollm2_dir, block_size=8, num_kv_blocks=8, log_stats=False)
    outs = small.generate([PROMPT] * 4, sampled, use_tqdm=False)
    assert small.llm_engine.metrics.total_preemptions > 0
    assert all(o.outputs[0].token_ids == alone for o in outs)


def test_n_completions(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # own generators: different draws
    again = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_string_cuts_text_and_streams_exactly(llm):
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop=["answer"])
    keep = SamplingParams(temperature=0.0, max_tokens=40, stop=["answer"], include_stop_str_in_output=True)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    res = run_streaming(llm, [PROMPT, PROMPT, PROMPT], [stop, keep, plain])
    out, streamed = res["s0"]
    assert out.outputs[0].text == " Paris.\n\nThe "
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "answer")
    assert streamed == out.outputs[0].text
    out, streamed = res["s1"]
    assert out.outputs[0].text == " Paris.\n\nThe answer" and streamed == out.outputs[0].text
    out, streamed = res["s2"]
    assert streamed == out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)


def test_stop_token_ids_and_min_tokens(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[NEWLINE]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [PARIS, DOT, NEWLINE]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", NEWLINE, " Paris.")
    # EOS (id 2) comes 30 tokens in when greedy; min_tokens holds it off
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=45, min_tokens=35),
                       use_tqdm=False)[0].outputs[0]
    assert 2 not in out.token_ids[:35] and len(out.token_ids) >= 35


def test_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) in (3, 4)
        assert lp[token] == max(lp.values()) and all(v <= 0 for v in lp.values())


def test_cli_generate_json_and_chat(smollm2_dir):
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--model", str(smollm2_dir), "--json", "--max-tokens", "3",
                               "--disable-log-stats", PROMPT, "Once upon a time"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [len(o["token_ids"]) for o in lines] == [3, 3]
    assert lines[0]["token_ids"] == [PARIS, DOT, NEWLINE] and lines[0]["finish_reason"] == "length"
    assert lines[0]["metrics"]["ttft"] > 0

    res = runner.invoke(main, ["chat", "--model", str(smollm2_dir), "--max-tokens", "4", "--disable-log-stats"],
                        input="What is the capital of France?\n/reset\nHi\n/exit\n")
    assert res.exit_code == 0, res.output
    assert "(history cleared)" in res.output
    assert res.output.count("> ") >= 3


def test_cli_reports_bad_input_cleanly(smollm2_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--model", str(tmp_path / "missing"), "hi"])
    assert res.exit_code == 2 and "does not exist" in res.output and "Traceback" not in res.output
    res = runner.invoke(main, ["generate", "--model", str(smollm2_dir), "--top-p", "1.5", "hi"])
    assert res.exit_code == 2 and res.stderr == "Error: --top-p=1.5 is invalid: must be in (0, 1]\n"
