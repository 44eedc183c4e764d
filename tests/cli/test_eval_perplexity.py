"""``refengine eval perplexity`` and :mod:`refengine.eval.perplexity`.

The perplexity of SmolLM2 equals the one transformers gives on the same windows; the
comparison of an engine with itself is exactly zero; KL divergence, top-1 agreement and
the position buckets match a direct torch computation on two tiny models; bad input is a
clear error; no KV block is left taken.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from refengine import LLMEngine
from refengine.cli import main
from refengine.eval.perplexity import (bos_token_id, compare, load_text, perplexity, tokenize, windows)

CTX = 64


def reference_nll(logits_per_window, wins: np.ndarray) -> np.ndarray:
    """Per scored token NLL (float64) from full-window logits ``[ctx, vocab]`` per window,
    the scoring rule written out again: logits at ctx//2 .. ctx-2 predict ctx//2+1 .. ctx-1."""
    ctx = wins.shape[1]
    out = []
    for logits, window in zip(logits_per_window, wins):
        logp = torch.log_softmax(torch.as_tensor(np.asarray(logits), dtype=torch.float64), dim=-1)
        rows = torch.arange(ctx // 2, ctx - 1)
        out.append((-logp[rows, torch.as_tensor(window[ctx // 2 + 1:])]).numpy())
    return np.stack(out)


def all_blocks_free(engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


# --- windows --------------------------------------------------------------------------------

def test_windows_are_consecutive_and_start_with_bos():
    ids = list(range(10, 21))  # 11 tokens: two windows of 4, the tail of 3 dropped
    np.testing.assert_array_equal(windows(ids, 4), [[10, 11, 12, 13], [14, 15, 16, 17]])
    np.testing.assert_array_equal(windows(ids, 4, bos_token_id=1), [[1, 11, 12, 13], [1, 15, 16, 17]])
    np.testing.assert_array_equal(windows(ids, 4, max_windows=1), [[10, 11, 12, 13]])
    assert ids[0] == 10


@pytest.mark.parametrize("ctx, message", [(2, "at least 3 tokens"), (1, "at least 3 tokens"),
                                          (True, "at least 3 tokens"), (12, "11 tokens, fewer than one window")])
def test_windows_refuse_bad_input(ctx, message):
    with pytest.raises(ValueError, match=message):
        windows(list(range(11)), ctx)
    with pytest.raises(ValueError, match="max_windows"):
        windows(list(range(11)), 4, max_windows=0)


# --- the real model against transformers -------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LLMEngine(smollm2_dir, log_stats=False)


@pytest.fixture(scope="module")
def corpus_ids(smollm2):
    return tokenize(smollm2, load_text())[:3 * CTX + 10]  # three windows


def test_perplexity_matches_transformers(smollm2, smollm2_dir, corpus_ids):
    from transformers import AutoModelForCausalLM

    assert bos_token_id(smollm2) is None  # SmolLM2's tokenizer adds no BOS: windows are the text as is
    result = perplexity(smollm2, corpus_ids, CTX)
    assert all_blocks_free(smollm2)
    assert (result.num_windows, result.num_tokens) == (3, 3 * (CTX - 1 - CTX // 2))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()
    wins = windows(corpus_ids, CTX)
    with torch.no_grad():
        want = reference_nll([hf(torch.as_tensor(w)[None]).logits[0] for w in wins], wins)
    np.testing.assert_allclose(result.nll, want, rtol=0, atol=2e-4)
    assert result.ppl == pytest.approx(math.exp(want.mean()), rel=2e-5)
    assert 1 < result.ppl < 200


def test_the_model_against_itself_is_zero(smollm2, corpus_ids):
    result = compare(smollm2, smollm2, corpus_ids, CTX, max_windows=2)
    assert all_blocks_free(smollm2)
    assert result.model.num_windows == 2
    assert result.kld_mean == pytest.approx(0, abs=1e-9) and result.kld_p99 == pytest.approx(0, abs=1e-9)
    assert result.delta_ppl == pytest.approx(0, abs=1e-6 * result.baseline.ppl)
    assert result.delta_ppl_pct == pytest.approx(0, abs=1e-4)
    assert result.top1_agreement == 1.0
    assert result.kld_by_quarter == pytest.approx([0] * 4, abs=1e-9)


# --- KL divergence and the buckets, on tiny models --------------------------------------------

@pytest.fixture(scope="module")
def perturbed_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with noise added to every weight: a "model" that differs from its baseline."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny-llama-perturbed")
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_comparison_matches_a_direct_computation(tiny_llama_dir, perturbed_llama_dir):
    model = LLMEngine(perturbed_llama_dir, log_stats=False, max_num_batched_tokens=24)  # chunks of the windows
    base = LLMEngine(tiny_llama_dir, log_stats=False)
    ids = np.random.default_rng(0).integers(0, 211, size=4 * CTX + 5)
    result = compare(model, base, ids, CTX)
    assert all_blocks_free(model) and all_blocks_free(base)
    wins = windows(ids, CTX)
    lp = [torch.log_softmax(torch.as_tensor(e.prompt_logits(w.tolist()), dtype=torch.float64), -1)[CTX // 2:-1]
          for e in (model, base) for w in wins]
    lp_model, lp_base = torch.stack(lp[:len(wins)]), torch.stack(lp[len(wins):])
    kld = (lp_base.exp() * (lp_base - lp_model)).sum(-1).numpy()
    np.testing.assert_allclose(result.kld, kld, rtol=1e-4, atol=1e-7)
    assert result.kld_mean > 1e-3  # the noise shows
    assert result.kld_p99 == pytest.approx(np.percentile(kld, 99), rel=1e-4)
    np.testing.assert_array_equal(result.same_top, (lp_base.argmax(-1) == lp_model.argmax(-1)).numpy())
    assert 0 < result.top1_agreement < 1
    quarters = np.array_split(np.arange(CTX - 1 - CTX // 2), 4)  # 31 scored positions: 8, 8, 8, 7
    assert result.kld_by_quarter == pytest.approx([kld[:, q].mean() for q in quarters], rel=1e-4)
    assert result.quarters() == [(33, 40), (41, 48), (49, 56), (57, 63)]
    want_model = math.exp(float(-lp_model.gather(-1, torch.as_tensor(wins[:, CTX // 2 + 1:])[..., None]).mean()))
    want_base = math.exp(float(-lp_base.gather(-1, torch.as_tensor(wins[:, CTX // 2 + 1:])[..., None]).mean()))
    assert result.model.ppl == pytest.approx(want_model, rel=1e-6)
    assert result.baseline.ppl == pytest.approx(want_base, rel=1e-6)
    assert result.delta_ppl == pytest.approx(want_model - want_base, rel=1e-5)
    assert result.delta_ppl_pct == pytest.approx(100 * (want_model - want_base) / want_base, rel=1e-5)
    # chunked under max_num_batched_tokens=24 or in one piece: the same perplexity
    assert perplexity(LLMEngine(perturbed_llama_dir, log_stats=False), ids, CTX).ppl == pytest.approx(
        result.model.ppl, rel=1e-5)


def test_bos_replaces_the_first_token_of_each_window(tiny_llama_tok_dir, tmp_path):
    for f in tiny_llama_tok_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "tokenizer_config.json").unlink()
    cfg = json.loads((tiny_llama_tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    engine = LLMEngine(tmp_path, log_stats=False)
    assert bos_token_id(engine) == 1 and bos_token_id(LLMEngine(tiny_llama_tok_dir, log_stats=False)) is None
    ids = tokenize(engine, "a" * 200)
    assert ids[0] == 1
    result = perplexity(engine, ids, CTX)
    wins = windows(ids, CTX, bos_token_id=1)
    assert (wins[:, 0] == 1).all() and wins.shape == (3, CTX)
    want = reference_nll([engine.prompt_logits(w.tolist()) for w in wins], wins)
    np.testing.assert_allclose(result.nll, want, rtol=1e-6, atol=1e-6)


# --- bad input ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_llama_tok_dir):
    return LLMEngine(tiny_llama_tok_dir, log_stats=False, max_model_len=128)


@pytest.mark.parametrize("ctx, n, message", [
    (2, 500, "ctx=2 is invalid: a window must have at least 3 tokens"),
    (129, 500, "ctx=129 is more than max_model_len=128"),
    (100, 99, "the text has 99 tokens, fewer than one window of ctx=100 tokens"),
])
def test_bad_input_is_a_clear_error(tiny, ctx, n, message):
    with pytest.raises(ValueError, match=message):
        perplexity(tiny, [5] * n, ctx)
    with pytest.raises(ValueError, match=message):
        compare(tiny, tiny, [5] * n, ctx)
    assert all_blocks_free(tiny)


def test_token_ids_outside_the_vocabulary(tiny):
    with pytest.raises(ValueError, match="token id 211 is outside the vocabulary"):
        perplexity(tiny, [5] * 60 + [211] + [5] * 10, 64)
    assert all_blocks_free(tiny)


def test_a_window_may_fill_max_model_len(tiny):
    assert perplexity(tiny, list(range(3, 131)), 128).num_tokens == 63
    with pytest.raises(ValueError, match="129 tokens but max_model_len is 128$"):
        tiny.prompt_logits(list(range(129)))
    with pytest.raises(ValueError, match="leave room for one generated token"):
        tiny.add_request("r", list(range(128)))
    with pytest.raises(ValueError, match=r"first_row=10 is outside \[0, 10\)"):
        tiny.prompt_logits([5] * 10, first_row=10)
    assert all_blocks_free(tiny)


# --- the command --------------------------------------------------------------------------------

TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 3  # 228 characters


def test_cli_with_a_baseline_as_json(tiny_llama_tok_dir, tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    res = CliRunner().invoke(main, ["eval", "perplexity", "--model", str(tiny_llama_tok_dir), "--ctx", "64",
                                    "--file", str(path), "--baseline", "--json", "--disable-log-stats"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["config"]["num_text_tokens"] == len(TEXT) and out["config"]["ctx"] == 64
    assert out["config"]["baseline_overrides"]["dtype"] == "float32"
    assert out["model"]["num_windows"] == 3 and out["model"]["num_tokens"] == 3 * 31
    assert out["kld_mean"] == 0 and out["delta_ppl"] == 0 and out["top1_agreement"] == 1.0
    assert [q["positions"] for q in out["kld_by_quarter"]] == [[33, 40], [41, 48], [49, 56], [57, 63]]
    engine = LLMEngine(tiny_llama_tok_dir, log_stats=False)
    assert out["model"]["ppl"] == pytest.approx(perplexity(engine, tokenize(engine, TEXT), 64).ppl, rel=1e-6)


def test_cli_text_output(tiny_llama_tok_dir, tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    res = CliRunner().invoke(main, ["eval", "perplexity", "--model", str(tiny_llama_tok_dir), "--ctx", "64",
                                    "--file", str(path), "--baseline", "max_num_batched_tokens=16",
                                    "--disable-log-stats"])
    assert res.exit_code == 0, res.output
    assert "3 windows of the text's 228 tokens, 93 tokens scored" in res.stdout
    assert "baseline (max_num_batched_tokens=16): PPL = " in res.stdout
    assert "top-1 agreement: 100.00 % of 93 positions" in res.stdout
    assert "tokens 57-63" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--ctx", "2"], "Error: Invalid value for '--ctx': 2 is not in the range x>=3."),
    (["--ctx", "300"], "Error: ctx=300 is more than --max-model-len=256"),
    (["--ctx", "250"], "Error: the text has 228 tokens, fewer than one window of ctx=250 tokens"),
    (["--baseline", "dtype"], "Error: --baseline: 'dtype' is not key=value"),
    (["--baseline", "colour=red"], "Error: unknown engine option(s) 'colour'"),
])
def test_cli_bad_input(tiny_llama_tok_dir, tmp_path, args, message):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    res = CliRunner().invoke(main, ["eval", "perplexity", "--model", str(tiny_llama_tok_dir), "--file", str(path),
                                    *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(message), res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_cli_refuses_a_file_that_is_not_utf8(tiny_llama_tok_dir, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    res = CliRunner().invoke(main, ["eval", "perplexity", "--model", str(tiny_llama_tok_dir), "--file", str(path)])
    assert res.exit_code == 2 and "is not UTF-8 text: byte 3" in res.output, res.output
