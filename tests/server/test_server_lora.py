"""``refengine serve --lora-modules NAME=PATH``: the default model with a random PEFT adapter
(written here, A and B both non-zero); the request's ``model`` picks the adapter or the base,
``/v1/models`` lists both, an unknown name is a 404. (The adapter's numerics against peft:
tests/models/test_lora.py.)"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from tests.helpers import random_adapter

from refengine.cli import main


def test_serve_lora_modules(smollm2_dir, tmp_path, monkeypatch):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.helpers import ServerThread

    adapter = random_adapter(tmp_path / "shout", smollm2_dir)
    apps = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: apps.append(app))
    result = CliRunner().invoke(main, ["serve", "--model", str(smollm2_dir), "--lora-modules", f"shout={adapter}",
                                       "--num-kv-blocks", "4", "--max-model-len", "32", "--enforce-eager",
                                       "--disable-log-stats"])
    assert result.exit_code == 0, result.output
    base = smollm2_dir.name
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            "logprobs": 1}
    with ServerThread(apps[0]) as url, httpx.Client(base_url=url, timeout=60) as h:
        cards = h.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [(base, None), ("shout", base)]
        tuned = h.post("/v1/completions", json={**body, "model": "shout"}).json()
        plain = h.post("/v1/completions", json={**body, "model": base}).json()
        missing = h.post("/v1/completions", json={**body, "model": "whisper"})
    assert tuned["model"] == "shout" and plain["model"] == base
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == (f"the model 'whisper' does not exist; this server serves "
                                                  f"'{base}', 'shout'")
    engine = apps[0].state.serving.engine  # the same engine, offline: the server ran the adapter
    from refengine import SamplingParams

    lora = apps[0].state.serving.lora_requests["shout"]
    assert engine.list_loras() == [lora] and lora.lora_int_id == 1
    ids = tuned["choices"][0]["prompt_token_ids"]
    engine.add_request("offline", ids, SamplingParams(max_tokens=4, temperature=0.0), lora_request=lora)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].token_ids == tuned["choices"][0]["token_ids"]
    # the adapter matters: other tokens, or at least other log-probabilities
    assert tuned["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]
    assert abs(tuned["choices"][0]["logprobs"]["token_logprobs"][0]
               - plain["choices"][0]["logprobs"]["token_logprobs"][0]) > 0.01


@pytest.mark.parametrize("value, message", [
    ("noequals", "--lora-modules 'noequals' is invalid: give NAME=PATH"),
    ("=path", "--lora-modules '=path' is invalid"),
])
def test_bad_lora_modules_are_one_error_line(value, message, tiny_llama_dir):
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama_dir), "--lora-modules", value])
    assert result.exit_code != 0 and message in result.output, result.output


def test_an_adapter_that_does_not_load_stops_the_start(tiny_llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: pytest.fail("served a broken adapter"))
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama_dir), "--num-kv-blocks", "16",
                                       "--lora-modules", f"x={tmp_path}"])
    assert result.exit_code != 0
    assert f"--lora-modules: LoRA adapter {str(tmp_path)!r} has no adapter_config.json" in result.output
