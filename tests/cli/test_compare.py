"""``refengine compare``: against transformers on tiny models of every registered family, a
golden file that catches one perturbed weight, the golden round trip without transformers
installed, and ``--engine-url`` against ``refengine serve``.

The tiny models are the random-weight builders of tests/models/test_tiny_families.py and
tests/models/test_tiny_models.py with the character tokenizer of conftest's ``tiny_llama_tok_dir``
(CJK and emoji become ``<unk>``; the prompts still run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from refengine.cli import main
from refengine.compare import TOLERANCES, Observation, PromptSpec, Reference, score, topk_rest_kl

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = "4"
FAMILIES = ["llama", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "mistral", "qwen2"]


def add_char_tokenizer(path: Path, tok_dir: Path) -> None:
    """Copy the character tokenizer (and its chat template) into a model directory."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tok_dir / name).read_bytes())
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the family's own (sentencepiece) class
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def build_family(family: str, path: Path) -> None:
    import torch

    if family in ("llama", "qwen3"):
        from tests.models.test_tiny_models import build

        heads, kv = (4, 2) if family == "llama" else (9, 3)
        build(family, heads, kv, False, None, torch.float32, path)
    else:
        from tests.models.test_tiny_families import build

        build(family, path)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_llama_tok_dir):
    out = {}

    def get(family: str) -> Path:
        if family not in out:
            path = tmp_path_factory.mktemp(f"cmp-{family}")
            build_family(family, path)
            add_char_tokenizer(path, tiny_llama_tok_dir)
            out[family] = path
        return out[family]

    return get


def compare(*args: str):
    result = CliRunner().invoke(main, ["compare", *args, "--max-tokens", MAX_TOKENS, "--json"])
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]  # stderr may carry notes
    report = json.loads(lines[-1]) if lines else None
    return result, report


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_against_transformers(family_dirs, family, monkeypatch):
    if family == "qwen2":  # transformers 5 loads any Qwen2 tokenizer as Qwen2Tokenizer, whose own pre-tokenizer
        import transformers  # replaces the character one: load it as the file says, as refengine does

        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                            transformers.PreTrainedTokenizerFast.from_pretrained)
    result, report = compare("--model", str(family_dirs(family)))
    assert result.exit_code == 0, result.output
    assert report["ok"] and report["failures"] == []
    names = [p["name"] for p in report["prompts"]]
    assert names == ["chat", "code", "digits", "cjk", "emoji", "long"]
    tol = TOLERANCES["float32"]
    assert report["tolerance"]["max_abs_dlogprob"] == tol.max_abs_dlogprob
    for p in report["prompts"]:
        assert p["kl_estimator"] == "full" and p["tokenization_divergence"] is None
        assert p["max_abs_dlogprob"] < 1e-4, p  # measured ~1e-6 on these models
        assert p["mean_kl"] < 1e-8 and p["argmax_differs"] == [] and p["greedy_divergence"] is None, p
        assert p["rows_compared"] == p["num_prompt_tokens"] + p["num_continuation_tokens"]
    long = report["prompts"][-1]
    assert long["num_prompt_tokens"] >= 320  # past every window of these models (8)


@pytest.fixture(scope="module")
def llama(family_dirs, tmp_path_factory):
    """The tiny Llama, its golden file, and a copy with one weight perturbed."""
    path = family_dirs("llama")
    golden = tmp_path_factory.mktemp("golden") / "golden.json"
    result, report = compare("--model", str(path), "--save", str(golden))
    assert result.exit_code == 0 and report["saved"] == str(golden), result.output
    bad = tmp_path_factory.mktemp("perturbed")
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    # the embedding of one character, 'e': rows before its first occurrence are unchanged
    tensors["model.embed_tokens.weight"][3 + ord("e") - 32, 0] += 1.0
    save_file(tensors, bad / "model.safetensors")
    return path, golden, bad


def test_golden_file_format(llama):
    path, golden, _ = llama
    doc = json.loads(golden.read_text())
    assert doc["format"] == "refengine-golden" and doc["version"] == 1 and doc["top_k"] == 20
    assert set(doc["versions"]) >= {"refengine", "transformers", "torch"}
    import hashlib

    assert doc["model_sha256"] == {"model.safetensors": hashlib.sha256((path / "model.safetensors").read_bytes())
                                   .hexdigest()}
    p = next(p for p in doc["prompts"] if p["name"] == "code")
    n = len(p["prompt_token_ids"]) + len(p["continuation_token_ids"])
    assert len(p["continuation_token_ids"]) == int(MAX_TOKENS)
    assert len(p["top_token_ids"]) == len(p["top_logprobs"]) == n and len(p["next_logprobs"]) == n - 1
    assert all(len(row) == 20 and row == sorted(row, reverse=True) for row in p["top_logprobs"])
    assert doc["token_texts"][str(p["prompt_token_ids"][0])] == p["text"][0]  # one character per token
    assert doc["prompts"][0]["messages"][0]["role"] == "user"


def test_golden_passes_and_names_the_perturbed_position(llama):
    path, golden, bad = llama
    result, report = compare("--golden", str(golden), "--model", str(path))
    assert result.exit_code == 0, result.output
    assert all(p["kl_estimator"] == "top-20+rest" and p["max_abs_dlogprob"] < 1e-4 for p in report["prompts"])
    assert report["notes"] == []

    result, report = compare("--golden", str(golden), "--model", str(bad))
    assert result.exit_code == 1 and not report["ok"]
    assert any("sha256 differ" in n for n in report["notes"])
    code = next(p for p in report["prompts"] if p["name"] == "code")
    text = "def fibonacci(n):"  # the first 'e' is character 1: row 1 is the first changed one
    assert code["first_position_beyond"] == 1 and text[1] == "e"
    assert any(f.startswith("code: |Δlogprob| > 0.001 first at position 1 (after 'e', before 'f')")
               for f in report["failures"]), report["failures"]
    # the text report names it too
    text_out = CliRunner().invoke(main, ["compare", "--golden", str(golden), "--model", str(bad)])
    assert text_out.exit_code == 1
    assert "FAIL code: |Δlogprob| > 0.001 first at position 1" in text_out.output


NO_TRANSFORMERS = ("import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None; "
                   "from refengine.cli import main; sys.argv[0] = 'refengine'; main()")


def run_without_transformers(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", NO_TRANSFORMERS, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)


def test_golden_round_trip_without_transformers(llama):
    path, golden, bad = llama
    ok = run_without_transformers("compare", "--golden", str(golden), "--model", str(path))
    assert ok.returncode == 0, ok.stderr
    assert "all within the tolerances" in ok.stdout and "reference: golden" in ok.stdout
    failed = run_without_transformers("compare", "--golden", str(golden), "--model", str(bad))
    assert failed.returncode == 1 and "FAIL code: |Δlogprob|" in failed.stdout
    missing = run_without_transformers("compare", "--model", str(path))
    assert missing.returncode == 1 and "pip install 'refengine[compare]'" in missing.stderr


def serve(model_dir: Path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.helpers import ServerThread

    from refengine.core.engine import LLMEngine
    from refengine.server.api import create_app

    return ServerThread(create_app(LLMEngine(model_dir, num_kv_blocks=128, log_stats=False),
                                   served_model_name="tiny"))


def test_engine_url_against_refengine_serve(llama, tmp_path):
    path, golden, bad = llama
    with serve(path) as url:  # keyed by decoded text (the server has the tokenizer)
        result, report = compare("--golden", str(golden), "--engine-url", url + "/v1")
    assert result.exit_code == 0, result.output
    assert report["compared"] == {"kind": "server", "url": url + "/v1", "model": "tiny"}
    for p in report["prompts"]:
        assert p["max_abs_dlogprob"] < 1e-4 and p["greedy_divergence"] is None, p
        assert p["rows_compared"] == p["num_prompt_tokens"] + p["num_continuation_tokens"]

    bare = tmp_path / "no-tokenizer"  # keyed "token_id:N"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(path / name)
    with serve(bare) as url:
        result, report = compare("--golden", str(golden), "--engine-url", url + "/v1")
    assert result.exit_code == 0, result.output
    assert all(p["max_abs_dlogprob"] < 1e-4 for p in report["prompts"])

    with serve(bad) as url:
        result, report = compare("--golden", str(golden), "--engine-url", url + "/v1")
    assert result.exit_code == 1
    assert any(f.startswith("code: |Δlogprob| > 0.001 first at position 1") for f in report["failures"])


def test_bad_combinations_are_one_error_line(llama):
    path, golden, _ = llama
    result = CliRunner().invoke(main, ["compare", "--golden", str(golden), "some prompt"])
    assert result.exit_code == 2 and "Error: --golden takes its prompts from the file" in result.output
    not_golden = golden.parent / "other.json"
    not_golden.write_text("{}")
    result = CliRunner().invoke(main, ["compare", "--golden", str(not_golden), "--model", str(path)])
    assert result.exit_code == 2 and "is not a refengine golden file" in result.output


# --- the scoring rules on hand-made rows ------------------------------------------------------------

def test_topk_rest_kl_is_a_lower_bound_of_the_full_kl():
    rng = np.random.default_rng(0)
    from refengine.eval.perplexity import kl_divergence, log_softmax

    for _ in range(20):
        p, q = log_softmax(rng.normal(size=(1, 50)) * 3), log_softmax(rng.normal(size=(1, 50)) * 3)
        top = np.argsort(-p[0])[:5]
        est = topk_rest_kl(p[0, top], q[0, top])
        assert 0 <= est <= kl_divergence(p, q)[0] + 1e-12
    assert topk_rest_kl(p[0, top], p[0, top]) == pytest.approx(0, abs=1e-12)


def test_a_near_tie_flip_passes_and_a_clear_one_fails():
    """Row 1 of the reference is a near tie (margin 1e-3 between tokens 0 and 1)."""
    from refengine.eval.perplexity import log_softmax

    logits = np.array([[0.0, -1.5, -2, -3], [0.001, 0.0, -2, -3], [3.0, 0, 0, 0]])
    ref = Reference.from_logprobs(PromptSpec("t", text="x"), [0, 1], [2], log_softmax(logits).astype(np.float32),
                                  top_k=4)
    tol = TOLERANCES["lossy"]  # no |Δlogprob| bound: the flips alone decide

    def obs(rows):
        return Observation(None, [2], logprobs=log_softmax(np.array(rows)).astype(np.float32))

    near = score(ref, obs([logits[0], [0.0, 0.001, -2, -3], logits[2]]), tol, str)
    assert near.argmax_differs == [1] and near.ok
    clear = score(ref, obs([[-1.0, 0, -2, -3], logits[1], logits[2]]), tol, str)
    assert clear.argmax_differs == [0] and not clear.ok
    assert any("the most likely token differs at position 0" in f for f in clear.failures), clear.failures


def test_default_model_passes(smollm2_dir):
    """The real default model (marked slow by conftest): every built-in prompt, tokenizer included.
    The suite's longest single test (minutes on a shared 2-core machine): the command's
    default run, both engines over all six prompts, the long one included. refengine on one
    numba thread: its log-probabilities do not depend on the thread count (batch invariance),
    and one thread spares the engine's start the warm-up of the parallel kernels."""
    result, report = compare("--model", str(smollm2_dir), "--num-threads", "1")
    assert result.exit_code == 0, result.output
    assert [p["name"] for p in report["prompts"]] == ["chat", "code", "digits", "cjk", "emoji", "long"]
    for p in report["prompts"]:
        assert p["tokenization_divergence"] is None and p["max_abs_dlogprob"] < 2e-4, p  # measured ~5e-5


def test_lora_adapter_on_both_sides(family_dirs, tmp_path):
    """``--lora-path``: transformers + peft against refengine with the adapter (random, non-zero
    B), saved to a golden file that then needs the same adapter."""
    import copy

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    path = family_dirs("llama")
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(base), cfg).save_pretrained(tmp_path / "adapter")
    golden = tmp_path / "golden.json"
    result, report = compare("--model", str(path), "--lora-path", str(tmp_path / "adapter"), "--save", str(golden),
                             "def fibonacci(n):")
    assert result.exit_code == 0, result.output
    assert report["reference"]["lora"] == report["compared"]["lora"] == str(tmp_path / "adapter")
    assert "peft" in report["reference"]["versions"]
    [p] = report["prompts"]
    assert p["max_abs_dlogprob"] < 1e-4 and p["greedy_divergence"] is None, p
    assert json.loads(golden.read_text())["lora"]["path"] == str(tmp_path / "adapter")
    result, report = compare("--model", str(path), "--golden", str(golden), "--lora-path", str(tmp_path / "adapter"))
    assert result.exit_code == 0 and report["ok"], result.output
    result, report = compare("--model", str(path), "--golden", str(golden))  # the base model is not the adapter
    assert result.exit_code == 2 and f"was made with the LoRA adapter {tmp_path / 'adapter'}: give --lora-path" \
        in result.output
