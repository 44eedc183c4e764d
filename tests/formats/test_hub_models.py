"""Models by their Hugging Face Hub name (refengine/hub.py), resolved from a cache this test lays
out the way ``huggingface_hub`` does (``models--org--name/{refs,snapshots,blobs}``, snapshot
files linking to blobs). This machine reaches no Hub: downloading is not exercised here, only
the cache, offline mode and the errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.formats.tiny_gguf import tiny_gguf
from tests.helpers import ROOT

from refengine import LLM, SamplingParams
from refengine.engine_args import EngineArgs, default_served_model_name, resolve_model_dir
from refengine.hub import HubModel, parse_hub_id

COMMIT = "a" * 40
OTHER = "b" * 40


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, ref: str | None = "main") -> Path:
    """Lay ``files`` out as ``huggingface_hub`` caches them: blobs named by their sha256, the
    snapshot's files relative symlinks to them, ``refs/<ref>`` holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tiny_llama_tok_dir, tmp_path_factory) -> Path:
    """A Hub cache with ``test-org/tiny-llama`` (main and tag v1 at another commit without
    weights), ``test-org/tiny-gguf`` holding one GGUF file."""
    cache = tmp_path_factory.mktemp("hf-cache")
    files = {f.name: f.read_bytes() for f in tiny_llama_tok_dir.iterdir()}
    add_snapshot(cache, "test-org/tiny-llama", files, COMMIT)
    add_snapshot(cache, "test-org/tiny-llama", {"config.json": files["config.json"]}, OTHER, ref="v1")
    gguf = tiny_gguf(tmp_path_factory.mktemp("gguf") / "x.gguf", arch="llama")
    add_snapshot(cache, "test-org/tiny-gguf", {"tiny.Q8_0.gguf": gguf.read_bytes()}, COMMIT)
    return cache


@pytest.fixture
def offline(cache, monkeypatch):
    """huggingface_hub's constants as HF_HUB_CACHE=cache HF_HUB_OFFLINE=1 would set them at import."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize("text, gguf_file, want", [
    ("org/name", None, HubModel("org/name")),
    ("org/name@v1.0", None, HubModel("org/name", "v1.0")),
    ("org/name/m.Q4_K_M.gguf", None, HubModel("org/name", None, "m.Q4_K_M.gguf")),
    ("org/name/m.gguf@" + COMMIT, None, HubModel("org/name", COMMIT, "m.gguf")),
    ("org/name", "m.gguf", HubModel("org/name", None, "m.gguf")),
    ("/abs/path", None, None), ("./org/name", None, None), ("~/models/x", None, None),
    ("a/b/c", None, None), ("org--x/name", None, None), ("org/na..me", None, None), ("name", None, None),
])
def test_parse_hub_id(text, gguf_file, want):
    assert parse_hub_id(text, gguf_file) == want


@pytest.mark.parametrize("text, gguf_file, match", [
    ("org/name", "dir/m.gguf", "must be a '.gguf' file name"),
    ("org/name", "m.bin", "must be a '.gguf' file name"),
    ("org/name/a.gguf", "b.gguf", "names a GGUF file and gguf_file='b.gguf' names another"),
])
def test_parse_hub_id_refuses(text, gguf_file, match):
    with pytest.raises(ValueError, match=match):
        parse_hub_id(text, gguf_file)


def test_safetensors_model_by_name(offline, tiny_llama_tok_dir):
    """``LLM(model="org/name")`` runs the cached snapshot: the same tokens as the directory itself."""
    snapshot = offline / "models--test-org--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model_dir("test-org/tiny-llama") == snapshot
    assert resolve_model_dir(f"test-org/tiny-llama@{COMMIT}") == snapshot
    assert resolve_model_dir("test-org/tiny-llama@main") == snapshot
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    by_name = LLM(model="test-org/tiny-llama", attention_backend="numpy", num_kv_blocks=16)
    by_path = LLM(model=str(tiny_llama_tok_dir), attention_backend="numpy", num_kv_blocks=16)
    out = by_name.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == by_path.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert by_name.llm_engine.model_dir == snapshot
    assert default_served_model_name("test-org/tiny-llama", snapshot) == "test-org/tiny-llama"
    assert default_served_model_name(str(tiny_llama_tok_dir), tiny_llama_tok_dir) == tiny_llama_tok_dir.name


def test_gguf_model_by_name(offline):
    """Both GGUF spellings name the cached file; its config reads as from a local path."""
    path = offline / "models--test-org--tiny-gguf" / "snapshots" / COMMIT / "tiny.Q8_0.gguf"
    assert resolve_model_dir("test-org/tiny-gguf", gguf_file="tiny.Q8_0.gguf") == path
    assert resolve_model_dir("test-org/tiny-gguf/tiny.Q8_0.gguf@main") == path
    model_path, config = EngineArgs(model="test-org/tiny-gguf", gguf_file="tiny.Q8_0.gguf").model_config()
    assert model_path == path and config.architecture == "LlamaForCausalLM" and config.num_hidden_layers == 2


@pytest.mark.parametrize("model, gguf_file, missing", [
    ("test-org/absent", None, "'test-org/absent' (revision main)"),
    ("test-org/tiny-llama@v2", None, "'test-org/tiny-llama' (revision v2)"),
    ("test-org/tiny-gguf/other.gguf", None, "file 'other.gguf' of 'test-org/tiny-gguf' (revision main)"),
    ("test-org/tiny-gguf", "other.gguf", "file 'other.gguf' of 'test-org/tiny-gguf'"),
])
def test_not_cached_offline(offline, model, gguf_file, missing):
    """Offline, what the cache lacks is an error naming the repository, revision, file, the
    cache and how to fetch it, not a network wait."""
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir(model, gguf_file)
    msg = str(e.value)
    assert missing in msg and str(offline) in msg and "HF_HUB_OFFLINE is set" in msg
    assert f"no local path {model!r}" in msg
    assert "hf download test-org/" in msg


def test_incomplete_snapshot_names_the_missing_file(offline):
    """Tag v1's snapshot has config.json only: the weights are named as missing."""
    with pytest.raises(FileNotFoundError, match=r"revision v1\) .* is incomplete: model\.safetensors"):
        resolve_model_dir("test-org/tiny-llama@v1")


def test_gguf_file_needs_a_hub_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="gguf_file='x.gguf' names a file of a Hugging Face repository"):
        resolve_model_dir(str(tiny_llama_dir), gguf_file="x.gguf")


def test_hf_home_and_offline_from_the_environment(cache, tmp_path):
    """A fresh process with HF_HOME (no HF_HUB_CACHE) and HF_HUB_OFFLINE=1 finds the cache at
    $HF_HOME/hub, as huggingface_hub reads its environment at import."""
    home = tmp_path / "hf-home"
    shutil.copytree(cache, home / "hub", symlinks=True)  # a link to the cache would be resolved to it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    code = ("from refengine.engine_args import resolve_model_dir as r; print(r('test-org/tiny-llama')); "
            "print(r('test-org/tiny-gguf/tiny.Q8_0.gguf'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(home / "hub" / "models--test-org--tiny-llama" / "snapshots" / COMMIT),
                                  str(home / "hub" / "models--test-org--tiny-gguf" / "snapshots" / COMMIT
                                      / "tiny.Q8_0.gguf")]
