"""What one request must not do to the others, and the server's small API rules (issue 24).

- output: DELTA outputs copy O(new tokens) per step; a slow reader's backlog is merged.
- limits: stop strings / stop ids, text size before tokenizing, tokenizing off the loop.
- supervision: a failing add, a failing step, a dead loop (500 / 503, /health 503).
- auth on every route but /health, stream headers, uvicorn's bounds, no internal text in 500s.
- cache_salt in the prefix-cache hash; /openapi.json; /tokenize's message checks.

The tiny random Llama (tests/conftest.py) keeps this fast; servers run in a thread
(``ServerThread`` of tests/helpers.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from refengine.core.block_manager import BlockManager, cache_salt_key, hash_block_tokens  # noqa: E402
from refengine.core.engine import LLM, LLMEngine  # noqa: E402
from refengine.core.sequence import Sequence  # noqa: E402
from refengine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from refengine.server.api import ServerLimits, create_app  # noqa: E402
from refengine.server.engine_loop import AsyncEngine  # noqa: E402
from tests.helpers import KEY, TIMEOUT, ServerThread, metric, wait_until  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


def completion(h, body: dict, headers=AUTH) -> httpx.Response:
    return h.post("/v1/completions", json={"model": "tiny", **body}, headers=headers)


# --------------------------------------------------------------------------------------
# 1. Outputs: deltas, merged backlogs
# --------------------------------------------------------------------------------------

def run_outputs(engine, params, prompt=(5, 6, 7)) -> list:
    engine.add_request("r", prompt if isinstance(prompt, str) else list(prompt), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_delta_outputs_copy_only_the_new_tokens(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, log_stats=False)
    base = dict(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=20)
    deltas = run_outputs(engine, SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    cumulative = run_outputs(engine, SamplingParams(**base))
    assert len(deltas) == len(cumulative) == 40
    # elements each output carries: constant for DELTA, growing with the step for CUMULATIVE
    copied = [len(o.outputs[0].token_ids) + len(o.outputs[0].logprobs) for o in deltas]
    assert copied == [2] * 40
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 41))
    whole = cumulative[-1].outputs[0]
    assert sum((o.outputs[0].token_ids for o in deltas), []) == whole.token_ids
    assert sum((o.outputs[0].logprobs for o in deltas), []) == whole.logprobs
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    final_only = run_outputs(engine, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].token_ids == whole.token_ids
    assert final_only[0].outputs[0].logprobs == whole.logprobs


def test_delta_text_concatenates_to_the_whole_text(tiny_llama_tok_dir):
    engine = LLMEngine(tiny_llama_tok_dir, num_kv_blocks=64, log_stats=False)
    base = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    deltas = run_outputs(engine, SamplingParams(**base, output_kind=RequestOutputKind.DELTA), "hello")
    whole = run_outputs(engine, SamplingParams(**base), "hello")[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in deltas) == whole.text != ""


def test_llm_generate_returns_whole_outputs_and_leaves_the_params_alone(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, num_kv_blocks=64, log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    [out] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12 and len(out.outputs[0].logprobs) == 12
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_a_slow_readers_backlog_is_one_merged_output(tiny_llama_dir):
    """Nobody reads while 50 steps run: one pending output holding all 50 tokens, not 50."""
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, logprobs=20,
                            output_kind=RequestOutputKind.DELTA)

    async def main():
        loop = AsyncEngine(engine)
        loop.start()
        try:
            stream = await loop.submit("slow", [[5, 6, 7], [8, 9]], params)
            while engine.has_unfinished_requests() or loop.num_steps < 50:
                await asyncio.sleep(0.01)
            assert stream.num_pending == 2  # one merged output per prompt
            got = [item async for item in stream]
        finally:
            await loop.stop()
        return loop, got

    loop, got = asyncio.run(main())
    assert loop.num_steps == 50
    assert sorted(tag for tag, _ in got) == [0, 1]
    for _, out in got:
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "length"
        assert len(c.token_ids) == len(c.logprobs) == len(c.delta_token_ids) == 50


# --------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok_server(tiny_llama_tok_dir):
    """The tiny model with its character tokenizer, prefix caching on, a key set."""
    engine = LLMEngine(tiny_llama_tok_dir, num_kv_blocks=128, log_stats=False)
    app = create_app(engine, served_model_name="tiny", api_key=KEY)
    server = ServerThread(app)
    with server as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
            yield h, engine, app, server.thread.name  # the thread of the server's event loop


@pytest.mark.parametrize("body,param,fragment", [
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "17 stop strings"),
    ({"stop": "x" * 257}, "stop", "257 characters"),
    ({"stop_token_ids": list(range(3, 260))}, "stop_token_ids", "257 stop_token_ids"),
    ({"cache_salt": 7}, "cache_salt", "string"),
    ({"cache_salt": ""}, "cache_salt", "non-empty"),
    ({"bad_words": [f"w{i}" for i in range(257)]}, "bad_words", "257 bad_words is above the server's limit of 256"),
    ({"bad_words": ["x" * 257]}, "bad_words", "a bad word of 257 characters is above the server's limit of 256"),
    ({"allowed_token_ids": [5] * 212}, "allowed_token_ids",
     "212 allowed_token_ids is above the vocabulary's size of 211"),
    ({"guided_choice": ["a"] * 1001}, "guided_choice", "1001 choices is above the server's limit of 1000"),
    ({"structured_outputs": {"choice": ["a"] * 1001}}, "structured_outputs", "1001 choices is above"),
    ({"guided_regex": "a" * 65537}, "guided_regex",
     "guided_regex of 65537 characters is above the server's limit of 65536"),
    ({"guided_grammar": "start: " + "a" * 65536}, "guided_grammar", "of 65543 characters is above"),
    ({"guided_json": {"enum": ["x" * 65536]}}, "guided_json", "of 65550 characters (as JSON) is above"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["é" * 65536]}}}},
     "response_format", "characters (as JSON) is above the server's limit of 65536"),
])
def test_request_limits_answer_400(tok_server, body, param, fragment):
    h, *_ = tok_server
    r = completion(h, {"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]


def test_requests_at_the_limits_run(tok_server):
    h, *_ = tok_server
    r = completion(h, {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(16)],
                       "stop_token_ids": [5] * 300})  # the bound counts the ids as sent
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    r = completion(h, {"prompt": "hi", "max_tokens": 2, "ignore_eos": True, "stop": [f"s{i}" for i in range(16)],
                       "stop_token_ids": [100 + i % 100 for i in range(256)]})
    assert r.status_code == 200, r.text


def test_text_is_size_checked_then_tokenized_off_the_event_loop(tok_server, monkeypatch):
    h, engine, app, loop_thread = tok_server
    tok = engine.tokenizer
    threads = []
    encode, render = tok.encode, tok.apply_chat_template

    def spy_encode(*a, **k):
        threads.append(threading.current_thread().name)
        return encode(*a, **k)

    def spy_render(*a, **k):
        threads.append(threading.current_thread().name)
        return render(*a, **k)

    monkeypatch.setattr(tok, "encode", spy_encode)
    monkeypatch.setattr(tok, "apply_chat_template", spy_render)
    limit = 256 * 32  # max_model_len x ServerLimits.max_chars_per_token
    r = completion(h, {"prompt": "a" * (limit + 1), "max_tokens": 1})
    assert r.status_code == 400 and str(limit) in r.json()["error"]["message"]
    r = h.post("/v1/chat/completions", headers=AUTH,
               json={"messages": [{"role": "user", "content": "a" * (limit + 1)}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = h.post("/tokenize", headers=AUTH, json={"prompt": "a" * (1024 * 1024 + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert threads == []  # refused before any tokenizer pass
    assert completion(h, {"prompt": "hello", "max_tokens": 1}).status_code == 200
    assert h.post("/tokenize", headers=AUTH, json={"prompt": "a" * 20000}).json()["count"] >= 20000
    r = h.post("/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(threads) >= 4
    assert loop_thread not in threads


def test_checks_that_touch_the_tokenizer_or_a_grammar_run_off_the_event_loop(tok_server, monkeypatch):
    """bad_words are tokenized and a grammar compiled in a worker thread, once: the engine's
    own check when the loop adds the request reuses them, and the request's one sequence
    takes the matcher the check made. llguidance's tokenizer was built at startup."""
    from refengine import sampler, structured_output

    h, engine, app, loop_thread = tok_server
    assert engine.sampler.structured._ll_tokenizer is not None  # built before serving
    threads = {"encode": [], "bad_words": [], "compile": [], "matcher": []}

    def spy(name, fn):
        def call(*a, **k):
            threads[name].append(threading.current_thread().name)
            return fn(*a, **k)
        return call

    monkeypatch.setattr(engine.tokenizer, "encode", spy("encode", engine.tokenizer.encode))
    monkeypatch.setattr(sampler, "bad_words_token_ids", spy("bad_words", sampler.bad_words_token_ids))
    monkeypatch.setattr(structured_output.StructuredOutputsParams, "_compile",
                        spy("compile", structured_output.StructuredOutputsParams._compile))
    monkeypatch.setattr(engine.sampler.structured, "new_matcher",
                        spy("matcher", engine.sampler.structured.new_matcher))
    r = completion(h, {"prompt": [5, 6, 7], "max_tokens": 3, "bad_words": ["ab", "cd"],
                       "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    assert [len(threads[k]) for k in ("bad_words", "compile", "matcher")] == [1, 1, 1]
    assert threads["encode"] and loop_thread not in sum(threads.values(), [])


def test_oversized_requests_do_not_stall_health_or_streams(tok_server):
    """While one client streams and another polls /health, requests with every oversized
    list (bad_words, guided_choice, allowed_token_ids, a regex, a chat) get a 400, and
    requests at the limits finish: no /health answer and no stream chunk waits over 1 s."""
    h, *_ = tok_server
    done = threading.Event()
    health, chunks = [time.monotonic()], [time.monotonic()]

    def poll_health():
        with httpx.Client(base_url=h.base_url, timeout=TIMEOUT) as c:
            while not done.is_set():
                assert c.get("/health").status_code == 200
                health.append(time.monotonic())
                time.sleep(0.01)

    def stream():
        with httpx.Client(base_url=h.base_url, headers=AUTH, timeout=TIMEOUT) as c:
            while not done.is_set():
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        chunks.append(time.monotonic())

    workers = [threading.Thread(target=f, daemon=True) for f in (poll_health, stream)]
    for w in workers:
        w.start()
    wait_until(lambda: len(chunks) > 20 and len(health) > 5)
    oversized = [{"bad_words": [f"w{i}x" for i in range(12000)]},
                 {"guided_choice": [f"choice {i}" for i in range(60000)]},
                 {"allowed_token_ids": [5] * 300000},
                 {"guided_regex": "(" + "|".join(f"w{i}" for i in range(20000)) + ")"}]
    statuses = [completion(h, {"prompt": "hi", "max_tokens": 2, **body}).status_code for body in oversized]
    r = h.post("/v1/chat/completions", headers=AUTH,
               json={"messages": [{"role": "user", "content": "a" * 1000}] * 1000, "max_tokens": 2})
    statuses.append(r.status_code)
    at_limits = [{"bad_words": [f"w{i}x" for i in range(256)]},
                 {"guided_choice": [f"choice {i}" for i in range(1000)]},
                 {"allowed_token_ids": list(range(211))}]
    statuses += [completion(h, {"prompt": "hi", "max_tokens": 2, **body}).status_code for body in at_limits]
    time.sleep(0.2)
    done.set()
    for w in workers:
        w.join(timeout=TIMEOUT)
    gaps = {name: max(b - a for a, b in zip(t, t[1:])) for name, t in (("/health", health), ("stream", chunks))}
    assert max(gaps.values()) < 1.0, gaps
    assert statuses == [400] * 5 + [200] * 3


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": None}]},
])
def test_tokenize_without_messages_or_content_is_400(tok_server, body):
    h, *_ = tok_server
    r = h.post("/tokenize", headers=AUTH, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    if body["messages"]:
        r = h.post("/v1/chat/completions", headers=AUTH, json={**body, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_auth_covers_every_route_but_health(tok_server):
    h, *_ = tok_server
    for method, path in [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/v1/models"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions")]:
        r = h.request(method, path, json={})
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["type"] == "authentication_error"
    assert h.get("/health").status_code == 200
    assert h.get("/metrics", headers=AUTH).status_code == 200
    schema = h.get("/openapi.json", headers=AUTH).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models"} <= set(schema["paths"])
    assert h.get("/docs", headers=AUTH).status_code == 200


def test_metrics_open_only_when_asked_and_empty_keys_refused(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=32, log_stats=False)
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="api_key"):
            create_app(engine, served_model_name="tiny", api_key=bad)
    app = create_app(engine, served_model_name="tiny", api_key=KEY, metrics_auth=False)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        assert h.get("/metrics").status_code == 200
        assert h.get("/v1/models").status_code == 401
        assert h.get("/openapi.json").status_code == 401


def test_cli_refuses_an_empty_key_and_runs_uvicorn_with_bounds(tiny_llama_dir, monkeypatch):
    import uvicorn
    from click.testing import CliRunner

    from refengine.cli import main

    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama_dir), "--api-key", ""])
    assert result.exit_code != 0 and "--api-key" in result.output and "empty" in result.output
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama_dir), "--api-key", "  "])
    assert result.exit_code != 0 and "empty" in result.output
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama_dir), "--num-kv-blocks", "32",
                                       "--limit-concurrency", "7", "--timeout-keep-alive", "3",
                                       "--max-header-bytes", "4096", "--api-key", KEY, "--disable-metrics-auth"])
    assert result.exit_code == 0, result.output
    assert (seen["limit_concurrency"], seen["timeout_keep_alive"], seen["h11_max_incomplete_event_size"]) == \
        (7, 3, 4096)
    assert seen["http"] == "h11"  # the parser whose head limit that is
    models = seen["app"].state.serving.models().data[0]
    assert models.id == tiny_llama_dir.name and models.root == tiny_llama_dir.name


def test_stream_headers_and_no_model_path(tok_server):
    h, engine, *_ = tok_server
    with h.stream("POST", "/v1/completions", headers=AUTH,
                  json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        assert r.read().decode().rstrip().endswith("data: [DONE]")
    card = h.get("/v1/models", headers=AUTH).json()["data"][0]
    assert card["root"] == "tiny" and str(engine.model_dir) not in str(card)


def test_internal_errors_show_only_an_id(tok_server, monkeypatch, caplog):
    h, engine, app, _ = tok_server
    serving = app.state.serving

    def crash():
        raise RuntimeError("secret detail /home/me/weights")

    monkeypatch.setattr(serving, "models", crash)
    with caplog.at_level(logging.ERROR, logger="refengine.server"):
        r = h.get("/v1/models", headers=AUTH)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert message.startswith("internal error (request id ") and "secret" not in r.text
    request_id = message.rsplit(" ", 1)[-1].rstrip(")")
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and "secret detail" in logged[0].exc_text


# --------------------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------------------

def test_a_failing_add_fails_only_its_request(tiny_llama_dir, monkeypatch, caplog):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, log_stats=False)
    app = create_app(engine, served_model_name="tiny")
    add = engine.add_request
    calls = []

    def flaky_add(*a, **k):
        calls.append(a[0])
        if len(calls) == 1:
            raise KeyError("engine bug")
        return add(*a, **k)

    monkeypatch.setattr(engine, "add_request", flaky_add)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        with caplog.at_level(logging.ERROR, logger="refengine.server"):
            r = completion(h, {"prompt": [5, 6], "max_tokens": 2}, headers={})
        assert r.status_code == 500, r.text
        assert r.json()["error"]["message"].startswith("internal error (request id cmpl-")
        assert "KeyError" not in r.text and "engine bug" not in r.text
        assert any("engine bug" in (rec.exc_text or "") for rec in caplog.records)
        assert h.get("/health").status_code == 200
        r = completion(h, {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True}, headers={})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_steps_failing_in_a_row_end_the_loop_and_health_says_so(tiny_llama_dir, monkeypatch):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, log_stats=False)
    app = create_app(engine, served_model_name="tiny")

    def broken_step():
        raise RuntimeError("device lost at 0xdead")

    monkeypatch.setattr(engine, "step", broken_step)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = completion(h, {"prompt": [5, 6], "max_tokens": 2}, headers={})
        assert r.status_code == 500 and "0xdead" not in r.text
        assert h.get("/health").status_code == 200  # one failed step: the engine may recover
        with h.stream("POST", "/v1/completions", json={"prompt": [5], "max_tokens": 2, "stream": True}) as s:
            body = s.read().decode()
        assert "internal error (request id cmpl-" in body and "0xdead" not in body
        assert body.rstrip().endswith("data: [DONE]")
        r = completion(h, {"prompt": [5, 6], "max_tokens": 2}, headers={})  # the third in a row
        assert r.status_code in (500, 503)
        wait_until(lambda: h.get("/health").status_code == 503)
        assert not app.state.engine_loop.is_running
        r = completion(h, {"prompt": [5, 6], "max_tokens": 2}, headers={})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_a_loop_that_dies_fails_every_waiting_handler(tiny_llama_dir):
    """An error the loop does not expect (here: in the engine's bookkeeping) ends it; the
    handlers waiting on it get an error instead of hanging."""
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=64, log_stats=False)
    app = create_app(engine, served_model_name="tiny")
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        step = engine.step
        state = {"steps": 0}

        def step_then_break():
            state["steps"] += 1
            if state["steps"] == 3:
                engine.has_unfinished_requests = None  # calling it raises TypeError in the loop
            return step()

        engine.step = step_then_break
        r = completion(h, {"prompt": [5, 6], "max_tokens": 50, "ignore_eos": True}, headers={})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead"
        assert h.get("/health").status_code == 503
        assert app.state.engine_loop.dead is not None


# --------------------------------------------------------------------------------------
# cache_salt
# --------------------------------------------------------------------------------------

def test_cache_salt_key_is_length_prefixed():
    assert cache_salt_key(None) == b"" and cache_salt_key("") != cache_salt_key(None)
    bm = BlockManager(8, 4, enable_prefix_caching=True)

    def first_hash(tokens, salt):
        return bm.block_hash_of(Sequence("s", None, tokens, SamplingParams(), cache_salt=salt), 0)

    assert first_hash([1, 2, 3, 4, 5], "") != first_hash([1, 2, 3, 4, 5], None)
    assert first_hash([1, 2, 3, 4, 5], "a") != first_hash([1, 2, 3, 4, 5], "b")
    assert first_hash([1, 2, 3, 4, 5], "a") == hash_block_tokens(None, [1, 2, 3, 4], b"\x01" + bytes(7) + b"a")
    with pytest.raises(ValueError, match="cache_salt"):
        cache_salt_key(b"bytes")


def test_cache_salt_separates_prefix_cache_hits(tok_server):
    h, engine, *_ = tok_server
    prompt = "The same prompt of more than two blocks of sixteen characters each."

    def hits(**salt) -> float:
        before = metric(h.get("/metrics", headers=AUTH).text, "refengine:prefix_cache_hits_total")
        r = completion(h, {"prompt": prompt, "max_tokens": 1, **salt})
        assert r.status_code == 200, r.text
        return metric(h.get("/metrics", headers=AUTH).text, "refengine:prefix_cache_hits_total") - before

    hits(cache_salt="tenant-a")
    assert hits(cache_salt="tenant-b") == 0
    assert hits() == 0
    assert hits(cache_salt="tenant-a") >= 48
    assert hits(cache_salt="tenant-b") >= 48


def test_logprobs_of_ids_past_the_tokenizers_vocabulary(tok_server):
    """The tiny model has 211 rows and its tokenizer 101 tokens (as Qwen2.5 pads 151,665
    tokens to 151,936 rows): a top logprob of a row the tokenizer lacks is an empty token of
    no bytes, not a 500 (found by the chat fuzz)."""
    h, engine, *_ = tok_server
    assert engine.tokenizer.vocab_size < engine.model_config.vocab_size
    r = h.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3, "logprobs": True, "top_logprobs": 20, "seed": 0},
               headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    tops = [t for c in r.json()["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]]
    padded = [t for t in tops if t["token"] == ""]
    assert padded and all(t["bytes"] == [] for t in padded)
