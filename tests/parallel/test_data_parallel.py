"""Data-parallel replicas on Ray Serve (refengine.server.ray_serve): a local Ray cluster,
two SmolLM2 engine replicas behind one endpoint, prefix-affinity routing, a killed replica.

Skipped without Ray (``pip install 'refengine[distributed]'``) or the weights.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import time

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'refengine[distributed]'")
httpx = pytest.importorskip("httpx")

from refengine.server.ray_serve import (REPLICA_HEADER, merge_expositions, prefix_routing_key,  # noqa: E402
                                        rendezvous_order)

BLOCK = 16
HITS = "refengine:prefix_cache_hits_total"


def test_prefix_routing_key_and_rendezvous():
    ids = list(range(100, 200))
    key = prefix_routing_key(ids, BLOCK)
    assert key == prefix_routing_key(ids[:65] + [1, 2, 3], BLOCK)  # the first 4 blocks decide
    assert key != prefix_routing_key([7] + ids[1:], BLOCK)
    assert key != prefix_routing_key(ids, BLOCK, cache_salt="s")
    assert prefix_routing_key(ids[:16], BLOCK) is None  # no full block before the last token
    assert prefix_routing_key(ids[:17], BLOCK) is not None
    order = rendezvous_order(key, ["a", "b", "c"])
    assert sorted(order) == ["a", "b", "c"] and rendezvous_order(key, ["c", "a", "b"]) == order
    assert rendezvous_order(key, [r for r in order if r != order[1]]) == [order[0], order[2]]


def test_merge_expositions():
    text = ('# HELP x_total X.\n# TYPE x_total counter\nx_total 3.0\n'
            '# HELP h H.\n# TYPE h histogram\nh_bucket{le="1.0"} 2.0\n')
    merged = merge_expositions({"r1": text, "r2": text.replace("3.0", "4.0")})
    assert merged.count("# TYPE x_total counter") == 1
    assert 'x_total{replica="r1"} 3.0' in merged and 'x_total{replica="r2"} 4.0' in merged
    assert 'h_bucket{replica="r2",le="1.0"} 2.0' in merged


def test_ingress_renders_only_the_head_of_a_chat_it_routes(tiny_llama_tok_dir, monkeypatch):
    """The routing key needs the first blocks of the prompt: the ingress renders and
    tokenizes a bounded head of the messages (32 characters per token, one block to spare),
    whatever the chat's size, and the key is the full render's."""
    from refengine.server.ray_serve import OpenAIIngress

    ingress = OpenAIIngress(None, str(tiny_llama_tok_dir), block_size=BLOCK, vocab_size=211)
    tok = ingress.tokenizer
    rendered = []
    render = tok.apply_chat_template

    def spy(messages, **kw):
        rendered.append(sum(len(m["content"]) + len(m.get("name", "")) for m in messages))
        return render(messages, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    head = 32 * 5 * BLOCK

    def key(messages):
        return ingress.routing_key("/v1/chat/completions", json.dumps({"messages": messages}).encode())

    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x" * 100, "name": "bob"}]
    assert key(short) == prefix_routing_key(render(short, add_generation_prompt=True, tokenize=True), BLOCK)
    huge = short + [{"role": "user", "content": f"line {i} " * 50} for i in range(200)]  # 100 kB
    rendered.clear()
    k = key(huge)
    assert rendered == [head]
    assert k == prefix_routing_key(render(huge, add_generation_prompt=True, tokenize=True), BLOCK)
    assert k == key(huge[:3] + [{"role": "user", "content": "another tail"}])
    assert k != key([{"role": "system", "content": "Be brief!"}] + huge[1:])
    # tools are in the prompt the replica renders (the generic format's system message)
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 300}}]
    body = json.dumps({"messages": short, "tools": tools}).encode()
    tools_key = ingress.routing_key("/v1/chat/completions", body)
    from refengine.server.protocol import ChatCompletionRequest

    messages, _ = ChatCompletionRequest.model_validate_json(body).tool_calling().render(short)
    assert tools_key == prefix_routing_key(render(messages, add_generation_prompt=True, tokenize=True), BLOCK)
    assert tools_key != key(short)


def test_build_app_reads_serve_run_arguments(smollm2_dir):
    from ray.serve import Application

    from refengine.server.ray_serve import build_app

    app = build_app({"model": str(smollm2_dir), "data_parallel_size": "2", "num_threads": "1",
                     "max_model_len": "512", "enable_prefix_caching": "true", "imbalanced_threshold": "8"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="max_model_len"):
        build_app({"model": str(smollm2_dir), "max_model_len": "0"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint(smollm2_dir):
    """A local Ray cluster (2 CPUs) serving DP = 2 replicas; yields the base URL."""
    import ray
    from ray import serve

    from refengine.server.ray_serve import APP_NAME, data_parallel_app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_SERVE_LOG_TO_STDERR": "0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = dict(model=str(smollm2_dir), max_model_len=1024, num_kv_blocks=160, num_threads=1,
                      block_size=BLOCK, log_stats=False)
        serve.run(data_parallel_app(engine, 2, num_cpus_per_replica=1, log_requests=False),
                  name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url, prompt, max_tokens=2, **extra):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _replicas(url) -> dict:
    r = httpx.get(f"{url}/replicas", timeout=60)
    assert r.status_code == 200, r.text
    return {x["replica_id"]: x for x in r.json()["data"]}


def _gauge(url, rid, name) -> float:
    """The sample ``name`` of replica ``rid``'s own /metrics."""
    r = httpx.get(f"{url}/metrics", params={"replica": rid}, timeout=60)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == rid
    [line] = [x for x in r.text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[-1])


def _hits(url, rid) -> float:
    return _gauge(url, rid, HITS)


def _prefix(seed, n=512) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(200, 40000, n)]


def test_two_replicas_answer(endpoint):
    replicas = _replicas(endpoint)
    assert len(replicas) == 2 and len({r["pid"] for r in replicas.values()}) == 2
    r = _complete(endpoint, "Hello, my name is")  # no full block: the least-loaded replica
    assert r.headers[REPLICA_HEADER] in replicas and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{endpoint}/health", timeout=30).status_code == 200


def test_shared_prefix_lands_on_one_replica_with_cache_hits(endpoint):
    replicas = list(_replicas(endpoint))
    before = {rid: _hits(endpoint, rid) for rid in replicas}
    prefix = _prefix(1)
    first = _complete(endpoint, prefix + [11, 12, 13]).headers[REPLICA_HEADER]  # fills the prefix cache
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rest = list(pool.map(lambda i: _complete(endpoint, prefix + [300 + i, 7, 8]), range(15)))
    assert {r.headers[REPLICA_HEADER] for r in rest} == {first}
    after = {rid: _hits(endpoint, rid) for rid in replicas}
    assert after[first] - before[first] >= 15 * 512  # each later request found all 32 prefix blocks
    other = [rid for rid in replicas if rid != first]
    assert all(after[rid] == before[rid] for rid in other)
    merged = httpx.get(f"{endpoint}/metrics", timeout=60).text
    assert all(f'{HITS}{{replica="{rid}"}}' in merged for rid in replicas)


def test_distinct_prefixes_reach_both_replicas_and_stream(endpoint):
    replicas = set(_replicas(endpoint))
    seen = {}
    for i in range(30):  # rendezvous hashing: each prefix picks a replica at random (1/2 each; 2**-29 to miss one)
        text = f"Report {i}: " + " ".join(f"item{i}-{j}" for j in range(40))
        seen[i] = _complete(endpoint, text).headers[REPLICA_HEADER]
        if set(seen.values()) == replicas:
            break
    assert set(seen.values()) == replicas
    again = f"Report {i}: " + " ".join(f"item{i}-{j}" for j in range(40)) + " more"
    assert _complete(endpoint, again).headers[REPLICA_HEADER] == seen[i]  # the same prefix, the same replica
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{endpoint}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] in replicas
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_killed_replica_is_restarted_and_no_request_is_lost(endpoint):
    replicas = _replicas(endpoint)
    prefix = _prefix(1)  # the previous test's prefix: affine to a known replica
    victim = _complete(endpoint, prefix + [5, 5]).headers[REPLICA_HEADER]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        running = pool.submit(_complete, endpoint, prefix + [4, 4], 128, ignore_eos=True)
        deadline = time.monotonic() + 60
        while _gauge(endpoint, victim, "refengine:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # until it runs on the victim
        # half affine to the victim, racing the kill; the other half of distinct 2-block
        # prefixes (routed by rendezvous hashing like any prefix, a quarter of the prefill)
        futures = [pool.submit(_complete, endpoint, (prefix if i % 2 else _prefix(50 + i, 2 * BLOCK)) + [i, 9], 8)
                   for i in range(8)]
        os.kill(replicas[victim]["pid"], signal.SIGKILL)
        answers = [f.result() for f in futures]  # every one answered 200
        rerun = running.result()  # non-streamed, nothing had reached the client: sent again, to the survivor
    assert rerun.headers[REPLICA_HEADER] != victim and rerun.json()["usage"]["completion_tokens"] == 128
    assert len(answers) == 8 and _complete(endpoint, prefix + [6, 6]).headers[REPLICA_HEADER] != victim
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # Ray Serve replaces the dead replica (a new replica id)
        now = _replicas(endpoint)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and victim not in now and len(set(now) & set(replicas)) == 1
    assert _complete(endpoint, "Hello again").headers[REPLICA_HEADER] in now
