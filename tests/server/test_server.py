"""The OpenAI-compatible server, over loopback HTTP, with the ``openai`` client.

Servers run in this process (uvicorn in a thread, bound to 127.0.0.1 on an ephemeral
port) and are stopped by their fixtures. The real SmolLM2 checks text and chat against
``LLM.generate``; the tiny random model (no tokenizer, token-id prompts) covers
concurrency, errors and limits, where text does not matter. Every client call has a
timeout and every wait loop a deadline.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from refengine.core.engine import LLM, LLMEngine  # noqa: E402
from refengine.sampling_params import SamplingParams  # noqa: E402
from refengine.server.api import ServerLimits, create_app  # noqa: E402
from tests.helpers import KEY, TIMEOUT, ServerThread, client, metric, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# --------------------------------------------------------------------------------------
# SmolLM2: text and chat equal LLM.generate
# --------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def add(a, b):"]
CHAT = [{"role": "user", "content": "Name a color."}]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """One SmolLM2 engine: reference outputs from ``LLM.generate`` first, then served. On one
    numba thread: the bits do not depend on the thread count (batch invariance), and one
    thread spares its start the warm-up of the parallel kernels."""
    llm = LLM(model=smollm2_dir, max_model_len=512, num_kv_blocks=192, log_stats=False,  # the tool calls' 25 sequences
              num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    chat_ids = llm.get_tokenizer().apply_chat_template(CHAT, tokenize=True)
    refs = llm.generate(PROMPTS + [chat_ids], greedy, use_tqdm=False)
    app = create_app(llm.llm_engine, served_model_name="smol")
    with ServerThread(app) as url:
        yield SimpleNamespace(url=url, engine=llm.llm_engine, loop=app.state.engine_loop,
                              completion_refs=refs[:2], chat_ref=refs[2], chat_ids=chat_ids,
                              client=client(url, key="unused"))


@pytest.fixture(scope="module")
def answers(smol):
    """Completions and chat, streamed and not, sent at once (they share engine steps)."""
    c = smol.client

    def completion():
        return c.completions.create(model="smol", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                                    extra_body={"return_token_ids": True})

    def completion_stream():
        return list(c.completions.create(model="smol", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"return_token_ids": True}))

    def chat():
        return c.chat.completions.create(model="smol", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                         logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})

    def chat_stream():
        return list(c.chat.completions.create(model="smol", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))

    calls = {"completion": completion, "completion_stream": completion_stream, "chat": chat,
             "chat_stream": chat_stream}
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {name: pool.submit(f) for name, f in calls.items()}
        return SimpleNamespace(**{name: f.result(timeout=TIMEOUT) for name, f in futures.items()})


def test_completions_equal_llm_generate(smol, answers):
    resp = answers.completion
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, ref in zip(resp.choices, smol.completion_refs):
        out = ref.outputs[0]
        assert choice.text == out.text
        assert choice.token_ids == out.token_ids
        assert choice.prompt_token_ids == ref.prompt_token_ids
        assert choice.finish_reason == out.finish_reason
        # float32 sums differ in the last digits with the batch's company
        assert choice.logprobs.token_logprobs == pytest.approx([lp[t] for t, lp in zip(out.token_ids, out.logprobs)],
                                                               abs=1e-4)
        assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs)
    n_prompt = sum(len(r.prompt_token_ids) for r in smol.completion_refs)
    n_out = sum(len(r.outputs[0].token_ids) for r in smol.completion_refs)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == \
        (n_prompt, n_out, n_prompt + n_out)

    text, ids, finish, usage = {0: "", 1: ""}, {0: [], 1: []}, {}, []
    for chunk in answers.completion_stream:
        if not chunk.choices:
            usage.append(chunk.usage)
            continue
        for c in chunk.choices:
            text[c.index] += c.text
            ids[c.index] += c.token_ids
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for i, ref in enumerate(smol.completion_refs):
        assert text[i] == resp.choices[i].text == ref.outputs[0].text
        assert ids[i] == ref.outputs[0].token_ids
        assert finish[i] == ref.outputs[0].finish_reason
    assert len(usage) == 1 and usage[0] == resp.usage


def test_chat_equals_llm_generate(smol, answers):
    ref = smol.chat_ref.outputs[0]
    resp = answers.chat
    assert resp.prompt_token_ids == smol.chat_ids
    assert len(resp.choices) == 2
    for choice in resp.choices:  # greedy: both completions are the reference
        assert choice.message.role == "assistant"
        assert choice.message.content == ref.text and choice.token_ids == ref.token_ids
        assert choice.finish_reason == ref.finish_reason
        assert [t.logprob for t in choice.logprobs.content] == \
            pytest.approx([lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        assert b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode() == ref.text
    assert resp.usage.prompt_tokens == len(smol.chat_ids)
    assert resp.usage.completion_tokens == 2 * len(ref.token_ids)

    chunks = answers.chat_stream
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(smol.chat_ids)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_logprob_bytes_are_each_tokens_own(smollm2_dir):
    """An emoji is three byte-level tokens, each decoding alone to U+FFFD: their ``bytes``
    (not U+FFFD's [239, 191, 189] three times) rebuild the emoji, as OpenAI's do."""
    from refengine.server.api import OpenAIServing
    from refengine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_dir)
    engine = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(max_model_len=512))
    serving = OpenAIServing(SimpleNamespace(engine=engine), "smol", ServerLimits())
    ids = tok.encode("😀")
    assert len(ids) == 3
    content = serving.chat_logprobs(ids, [{t: -0.5, 5: -1.0} for t in ids], top=2).content
    assert [t.token for t in content] == ["\ufffd"] * 3  # each token's text alone
    assert b"".join(bytes(t.bytes) for t in content) == "😀".encode()
    assert [bytes(t.top_logprobs[0].bytes) for t in content] == [tok.token_bytes(t) for t in ids]
    assert bytes(content[0].top_logprobs[1].bytes) == tok.decode([5], skip_special_tokens=False).encode()


def test_models_health_tokenize(smol):
    models = smol.client.models.list().data
    assert [m.id for m in models] == ["smol"] and models[0].max_model_len == 512
    with httpx.Client(base_url=smol.url, timeout=TIMEOUT) as h:
        assert h.get("/health").status_code == 200
        tok = smol.engine.tokenizer
        r = h.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
        assert r["tokens"] == tok.encode(PROMPTS[0], add_special_tokens=True) and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 512
        assert h.post("/tokenize", json={"messages": CHAT}).json()["tokens"] == smol.chat_ids
        assert h.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPTS[0]}


def test_stream_closed_after_two_chunks_is_aborted(smol):
    """Closing a stream aborts the request within two engine steps; KV usage returns to 0."""
    with httpx.Client(base_url=smol.url, timeout=TIMEOUT) as h:
        aborted_before = metric(h.get("/metrics").text, "refengine:request_success_total", '{finished_reason="abort"}')
    stream = smol.client.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    request_id = next(it).id
    next(it)
    assert request_id in smol.engine.requests
    steps_at_close = smol.loop.num_steps
    stream.close()
    wait_until(lambda: request_id not in smol.engine.requests)
    assert smol.loop.num_steps - steps_at_close <= 2
    with httpx.Client(base_url=smol.url, timeout=TIMEOUT) as h:
        text = h.get("/metrics").text
    assert metric(text, "refengine:kv_cache_usage_perc") == 0.0
    assert metric(text, "refengine:request_success_total", '{finished_reason="abort"}') == aborted_before + 1
    assert smol.engine.block_manager.usage == 0.0


def test_non_streamed_request_is_aborted_when_client_leaves(smol):
    with httpx.Client(base_url=smol.url, timeout=1.0) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True})
    wait_until(lambda: not smol.engine.has_unfinished_requests())
    assert smol.engine.block_manager.usage == 0.0


def test_bench_serve_against_the_server(smol, tmp_path):
    from click.testing import CliRunner

    from refengine.bench.serve import serve_bench

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(serve_bench, [
        "--base-url", smol.url, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
        "--request-rate", "inf,40", "--seed", "0", "--num-warmups", "0", "--json", str(out),
        "--plot", str(tmp_path / "sweep.png")])
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.output and "Median TTFT (ms)" in result.output
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == ["inf", 40.0]
    for run in report["runs"]:
        assert run["completed"] == 2 and run["failed"] == 0
        assert run["total_input_tokens"] == 16 and run["total_output_tokens"] == 4
        assert run["ttft_ms"]["median"] > 0 and run["e2el_ms"]["p99"] >= run["ttft_ms"]["p99"]
    assert (tmp_path / "sweep.png").stat().st_size > 0


# --------------------------------------------------------------------------------------
# Tiny model: concurrency, errors, limits
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, num_kv_blocks=256, log_stats=False)
    limits = ServerLimits(max_body_bytes=64 * 1024, max_n=4)
    app = create_app(engine, served_model_name="tiny", api_key=KEY, limits=limits)
    with ServerThread(app) as url:
        yield SimpleNamespace(url=url, engine=engine, loop=app.state.engine_loop, client=client(url))


def test_32_concurrent_streams_equal_solo_greedy(tiny, tiny_llama_dir):
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 211, size=int(rng.integers(3, 12))).tolist() for _ in range(32)]
    solo = LLM(model=tiny_llama_dir, num_kv_blocks=16, log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    refs = [solo.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    steps_before = len(tiny.engine.metrics.steps)

    def run(prompt):
        stream = tiny.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
        ids, finish = [], None
        for chunk in stream:
            ids += chunk.choices[0].token_ids
            finish = chunk.choices[0].finish_reason or finish
        return ids, finish

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(run, prompts, timeout=TIMEOUT))
    assert [r[0] for r in results] == refs
    assert all(r[1] == "length" for r in results)
    batch_sizes = [s.num_seqs for s in list(tiny.engine.metrics.steps)[steps_before:]]
    assert max(batch_sizes) > 1  # the requests really shared steps


def good_request(h: httpx.Client) -> None:
    r = h.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
               headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


ERROR_CASES = [
    # (name, headers, body or raw bytes, path, status, param, message fragments)
    ("no key", {}, {"prompt": [1]}, "/v1/completions", 401, None, ["API key"]),
    ("wrong key", {"Authorization": "Bearer nope"}, {"prompt": [1]}, "/v1/completions", 401, None, ["API key"]),
    ("unknown model", None, {"model": "gpt-9", "prompt": [1]}, "/v1/completions", 404, "model", ["gpt-9"]),
    ("top_p", None, {"prompt": [1], "top_p": 7}, "/v1/completions", 400, "top_p", ["top_p"]),
    ("n above limit", None, {"prompt": [1], "n": 5}, "/v1/completions", 400, "n", ["4"]),
    ("prompt too long", None, {"prompt": [5] * 300}, "/v1/completions", 400, "prompt", ["300", "256"]),
    ("max_tokens too many", None, {"prompt": [5] * 10, "max_tokens": 1000}, "/v1/completions", 400, "max_tokens",
     ["256", "1010"]),
    ("max_tokens 0", None, {"prompt": [5], "max_tokens": 0}, "/v1/completions", 400, "max_tokens", ["max_tokens"]),
    ("min_tokens > max", None, {"prompt": [5], "max_tokens": 2, "min_tokens": 3}, "/v1/completions", 400,
     "min_tokens", ["min_tokens"]),
    ("token outside vocab", None, {"prompt": [1, 211]}, "/v1/completions", 400, "prompt", ["211"]),
    ("negative stop id", None, {"prompt": [1], "stop_token_ids": [-1]}, "/v1/completions", 400, "stop_token_ids",
     ["stop_token_ids"]),
    ("empty prompt", None, {"prompt": []}, "/v1/completions", 400, "prompt", ["empty"]),
    ("text without tokenizer", None, {"prompt": "hello"}, "/v1/completions", 400, "prompt", ["tokenizer"]),
    ("chat without tokenizer", None, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions",
     400, "prompt", ["tokenizer"]),
    ("wrong type", None, {"prompt": [1], "temperature": "hot"}, "/v1/completions", 400, "temperature", ["number"]),
    ("missing prompt", None, {"max_tokens": 3}, "/v1/completions", 400, "prompt", ["prompt"]),
    ("logprobs above limit", None, {"prompt": [1], "logprobs": 21}, "/v1/completions", 400, "logprobs", ["20"]),
    ("suffix", None, {"prompt": [1], "suffix": "x"}, "/v1/completions", 400, "suffix", ["suffix"]),  # echo works now
    ("bad json", None, b'{"prompt": [1', "/v1/completions", 400, None, ["JSON"]),
    ("oversized body", None, {"prompt": [7] * 40000}, "/v1/completions", 413, None, ["65536"]),
    ("oversized chunked body", None, lambda: (b"[7, 7, 7, 7]" for _ in range(8000)), "/v1/completions", 413, None,
     ["65536"]),
    ("unknown path", None, {"prompt": [1]}, "/v1/nothing", 404, None, []),
    # OpenAI's and vLLM's 400s for a field that needs another
    ("stream_options without stream", None, {"prompt": [1], "stream_options": {"include_usage": True}},
     "/v1/completions", 400, "stream_options", ["stream_options", "stream: true"]),
    ("stream_options with stream false", None, {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                                                "stream_options": {"include_usage": True}},
     "/v1/chat/completions", 400, "stream_options", ["stream: true"]),
    ("tool_choice without tools", None, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none"},
     "/v1/chat/completions", 400, "tool_choice", ["tool_choice", "tools"]),
    # bad tool definitions (checked before the chat is rendered, so a model without a tokenizer answers them too)
    *[(f"tools: {name}", None, {"messages": [{"role": "user", "content": "hi"}], **body}, "/v1/chat/completions",
       400, param, fragments) for name, body, param, fragments in [
        ("type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", ["tools.0.type", "function"]),
        ("name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools",
         ["tools.0.function.name", "^[a-zA-Z0-9_-]{1,64}$"]),
        ("long name", {"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools", ["pattern"]),
        ("schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "tools", ["tools[0].function.parameters is not a valid JSON schema", "'objekt'"]),
        ("not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools", ["must be the schema of an object"]),
        ("twice", {"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", ["given twice"]),
        ("count", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools",
         ["129 tools", "limit of 128"]),
        ("unknown choice", {"tools": [{"type": "function", "function": {"name": "f"}}],
                            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", ["'g'"]),
        ("bad choice", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
         "tool_choice", ["tool_choice"]),
        ("forced and response_format", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                         "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", ["tool_choice 'required'"]),
    ]],
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_status_and_object_then_next_request_succeeds(tiny, case):
    name, headers, body, path, status, param, fragments = case
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    with httpx.Client(base_url=tiny.url, timeout=TIMEOUT) as h:
        if isinstance(body, bytes) or callable(body):  # raw bytes, or a generator: sent chunked, no length
            content = body() if callable(body) else body
            r = h.post(path, content=content, headers={**headers, "Content-Type": "application/json"})
        else:
            r = h.post(path, json=body, headers=headers)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
        assert error["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                                 413: "invalid_request_error"}[status]
        for fragment in fragments:
            assert fragment in error["message"], error["message"]
        good_request(h)


def test_openai_client_sees_the_error_object(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=1)
    assert e.value.status_code == 400
    assert e.value.code == "context_length_exceeded" and "300" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        client(tiny.url, key="wrong").models.list()
    assert tiny.client.completions.create(model="tiny", prompt=[5, 6], max_tokens=1).usage.completion_tokens == 1


def test_dashboard_queries_only_exposed_metrics(tiny):
    good_request(httpx.Client(base_url=tiny.url, timeout=TIMEOUT))
    text = httpx.get(f"{tiny.url}/metrics", timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"}).text
    exposed = set(re.findall(r"^(refengine:\w+)", text, re.M))
    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "refengine.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for e in exprs for name in re.findall(r"refengine:\w+", e)}
    assert len(queried) >= 10
    assert queried <= exposed, sorted(queried - exposed)


def test_overloaded_queue_answers_503(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, max_num_seqs=1, num_kv_blocks=64, log_stats=False)
    step = engine.step
    engine.step = lambda: (time.sleep(0.05), step())[1]  # slow steps: the queue stays full while we look
    app = create_app(engine, served_model_name="tiny", limits=ServerLimits(max_waiting_requests=1))
    body = {"prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True}
    with ServerThread(app) as url:
        c = client(url)
        running = c.completions.create(model="tiny", stream=True, prompt=body["prompt"], max_tokens=200,
                                       extra_body={"ignore_eos": True})
        next(iter(running))  # the first request holds the only sequence slot
        waiting = c.completions.create(model="tiny", stream=True, prompt=[3, 4], max_tokens=200)
        assert len(engine.scheduler.waiting) == 1
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "server_error"
        running.close()
        waiting.close()
        wait_until(lambda: not engine.has_unfinished_requests())
        done = c.completions.create(model="tiny", prompt=[3], max_tokens=2, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2


def test_serve_without_the_extra_names_it(monkeypatch, tiny_llama_dir):
    import sys

    from click.testing import CliRunner

    from refengine.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama_dir)])
    assert result.exit_code != 0
    assert "'serve' extra" in result.output and "pip install 'refengine[serve]'" in result.output


# --------------------------------------------------------------------------------------
# SmolLM2: tool calls (the tools above's server; refengine/server/tool_calls.py)
# --------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def arguments(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# functions whose calls are short (a few dozen tokens), so max_tokens never cuts one
TOOL_SCHEMAS = {
    "set_level": arguments({"level": DIGIT}),
    "set_unit": arguments({"unit": {"enum": ["celsius", "fahrenheit"]}}),
    "toggle": arguments({"on": {"type": "boolean"}}),
    "book_flight": arguments({"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    "move": arguments({"dx": DIGIT, "dy": DIGIT}),
    "pick": arguments({"items": {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 3}}),
    "place": arguments({"at": arguments({"row": DIGIT, "col": DIGIT})}),
    "rate": arguments({"stars": {"anyOf": [DIGIT, {"type": "null"}]}}),
    "turn": {"$defs": {"side": {"enum": ["left", "right"]}}, **arguments({"direction": {"$ref": "#/$defs/side"}})},
    "ping": arguments({}),
    "tag": arguments({"label": {"type": "string", "maxLength": 6}}),
    "schedule": arguments({"day": {"enum": ["mon", "tue"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}),
}
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_answers(smol):
    """Every tool request at once (they share engine steps): per schema, ``required`` (with
    get_weather beside it) or the function named, two samples each; the OpenAI SDK's two-turn
    loop; the loop's first turn streamed. 27 sequences of ~35 tokens: minutes on a busy
    2-core machine, hence the longer timeout."""
    timeout = 5 * TIMEOUT
    c = smol.client.with_options(timeout=timeout)

    def forced(i, name):
        tools = [{"type": "function", "function": {"name": name, "parameters": TOOL_SCHEMAS[name]}}]
        choice = {"type": "function", "function": {"name": name}} if i % 2 else "required"
        return c.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"Call {name}."}], n=2, temperature=1.0, seed=i,
            max_tokens=48, tools=tools + ([WEATHER_TOOL] if i % 4 == 0 else []), tool_choice=choice,
            parallel_tool_calls=i % 4 in (1, 2))  # not beside get_weather: two calls would not fit max_tokens

    def loop():
        messages = list(TOOL_QUESTION)
        first = c.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL],
                                          tool_choice="required", temperature=0, max_tokens=40)
        messages.append(first.choices[0].message)  # what the SDK's users append
        for call in first.choices[0].message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
        second = c.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                           max_tokens=12, extra_body={"return_token_ids": True})
        return first, second

    def streamed():
        return list(c.chat.completions.create(model="smol", messages=TOOL_QUESTION, tools=[WEATHER_TOOL],
                                              tool_choice="required", temperature=0, max_tokens=40, stream=True))

    with ThreadPoolExecutor(max_workers=len(TOOL_SCHEMAS) + 2) as pool:
        schemas = [pool.submit(forced, i, name) for i, name in enumerate(TOOL_SCHEMAS)]
        loop_future, stream_future = pool.submit(loop), pool.submit(streamed)
        return SimpleNamespace(forced=[f.result(timeout=timeout) for f in schemas],
                               loop=loop_future.result(timeout=timeout), stream=stream_future.result(timeout=timeout))


def test_forced_tool_calls_validate_against_their_schemas(tool_answers):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {**TOOL_SCHEMAS, "get_weather": WEATHER_TOOL["function"]["parameters"]}
    for i, (name, resp) in enumerate(zip(TOOL_SCHEMAS, tool_answers.forced)):
        assert len(resp.choices) == 2
        for choice in resp.choices:
            message = choice.message
            assert choice.finish_reason == "tool_calls", (name, message)
            assert message.content is None and message.tool_calls
            if i % 4 in (0, 3):  # parallel_tool_calls: false
                assert len(message.tool_calls) == 1
            for call in message.tool_calls:
                assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
                # required: either function of the request (get_weather beside every 4th)
                assert call.function.name in ((name, "get_weather") if i % 4 == 0 else (name,))
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_openai_sdk_tool_loop(smol, tool_answers):
    """Call, tool result, final answer: the second turn's prompt holds the call and the result."""
    first, second = tool_answers.loop
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content.strip()
    prompt = smol.engine.tokenizer.decode(second.prompt_token_ids, skip_special_tokens=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt


def test_streamed_tool_calls_equal_non_streamed(tool_answers):
    """OpenAI's chunks: the role, then per call one delta with id, type and name (arguments
    ""), one with the arguments; finish_reason "tool_calls" on the last."""
    whole = tool_answers.loop[0].choices[0].message
    chunks = [ch for ch in tool_answers.stream if ch.choices]
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == ""
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert len(parts) == 2 * len(whole.tool_calls)
    for k, call in enumerate(whole.tool_calls):
        head, args = parts[2 * k], parts[2 * k + 1]
        assert (head.index, head.type, head.function.name, head.function.arguments) == (k, "function",
                                                                                      call.function.name, "")
        assert re.fullmatch(r"call_[0-9a-f]{24}", head.id)
        assert (args.index, args.id, args.function.name, args.function.arguments) == (k, None, None,
                                                                                      call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
