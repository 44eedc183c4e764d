"""Data-parallel serving on Ray Serve: N engine replicas behind one OpenAI endpoint.

    refengine serve --data-parallel-size 2 --num-threads 1        # local Ray, or $RAY_ADDRESS
    serve run refengine.server.ray_serve:build_app data_parallel_size=2 num_threads=1

Two deployments (see docs/data_parallel.md):

- ``EngineReplica`` (``num_replicas`` = the data-parallel size): one ``LLMEngine`` with its
  own KV cache and prefix cache, served by the unchanged :func:`refengine.server.api.create_app`
  app, which the replica calls in process (ASGI) for each forwarded request. Every answer
  carries ``x-refengine-replica: <replica id>``.
- ``OpenAIIngress`` (one replica, the HTTP ingress): reads the request, computes its routing
  key (the hash of the prompt's first KV blocks), and forwards it through a
  ``DeploymentHandle`` whose request router is :class:`PrefixAffinityRouter`.

Routing (:class:`PrefixAffinityRouter`, after Ray Serve LLM's ``PrefixCacheAffinityRouter``,
which matches text prefixes in a prefix tree; here the key is a hash of token blocks):
rendezvous (highest-random-weight) hashing of the key over the live replicas picks the
affine replica, so the same prefix keeps landing on the same replica and a replica's death or
arrival moves only the keys it wins or held. When the affine replica's queue is more than
``imbalanced_threshold`` requests longer than the shortest queue, or it refuses (its
``max_ongoing_requests`` is reached), the least-loaded replica serves instead. A request
without a full KV block of prompt has no key and goes to the least-loaded replica.

This is the only module of refengine that imports Ray (``pip install 'refengine[distributed]'``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger("refengine.server")

REPLICA_HEADER = "x-refengine-replica"
APP_NAME = "refengine"
ENGINE_DEPLOYMENT = "EngineReplica"
#: Prompt blocks hashed into the routing key (block_size tokens each): prompts that agree on
#: their first ``ROUTING_PREFIX_BLOCKS * block_size`` tokens land together.
ROUTING_PREFIX_BLOCKS = 4
#: Queue-length excess (requests) over the least-loaded replica at which affinity yields to load.
IMBALANCED_THRESHOLD = 32
#: Requests one engine replica takes at once (Ray Serve's ``max_ongoing_requests``; Serve's
#: default of 5 would defeat continuous batching). The engine queues what it cannot run.
MAX_ONGOING_REQUESTS = 256
#: Tries of a request whose replica died before any of its answer was sent to the client.
MAX_ATTEMPTS = 3

# The live replica ids the router (one per handle, in the calling process) last saw, by
# deployment name: the ingress reads them to fan /metrics and /replicas out.
_LIVE_REPLICAS: dict[str, tuple[str, ...]] = {}


# --------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------


def prefix_routing_key(token_ids, block_size: int, num_blocks: int = ROUTING_PREFIX_BLOCKS,
                       cache_salt: str | None = None) -> str | None:
    """The routing key of a prompt: a hash of its first full KV blocks (at most ``num_blocks``).

    Only blocks the prefix cache can share count: full blocks that end before the prompt's
    last token (which the engine always computes). ``cache_salt`` is hashed in, as the
    engine's block hashes include it (salted requests share no blocks with others).

    Args:
        token_ids: the prompt's token ids (ints).
        block_size: tokens per KV block (the engine's ``block_size``).
        num_blocks: most blocks hashed.
        cache_salt: the request's ``cache_salt``.

    Returns:
        32 hex digits, or None when the prompt has no full block to share.
    """
    n = min(num_blocks, (len(token_ids) - 1) // block_size)
    if n < 1:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update((cache_salt or "").encode() + b"\0")
    h.update(np.asarray(token_ids[:n * block_size], dtype=np.int64).tobytes())
    return h.hexdigest()


def rendezvous_order(key: str, replica_ids) -> list[str]:
    """``replica_ids`` by their highest-random-weight score for ``key``, best first.

    Every router computes the same order from the same ids (no shared state); removing a
    replica moves only the keys it was first for.
    """
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}/{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router for ``EngineReplica``: prefix affinity, load as the fallback.

    Reads two keyword arguments of the handle call (``EngineReplica.forward``/``info``):
    ``routing_key`` (:func:`prefix_routing_key`, or None) and ``replica_id`` (pin the
    request to that replica, for per-replica ``/metrics``; a replica that is not live falls
    back to any one, which answers 404).

    Returns ranks for Ray's base router, which probes queue lengths and takes the shortest
    queue within the first rank that has a replica accepting the request:
    ``[[affine], [the others]]`` when balanced, ``[all]`` (least loaded) when the affine
    replica's queue exceeds the shortest by more than ``imbalanced_threshold``, or when
    there is no key.
    """

    def initialize_state(self, imbalanced_threshold: float = IMBALANCED_THRESHOLD):
        self._imbalanced_threshold = imbalanced_threshold

    def _publish(self) -> None:
        # Ray pickles a router's module by value: its copy of the globals is not the ingress's,
        # so the live set goes to the imported module's
        from refengine.server import ray_serve

        ray_serve._LIVE_REPLICAS[self._deployment_id.name] = tuple(sorted(r.unique_id for r in self._replica_id_set))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish()

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict:
        """Queue length per replica id: the cache, probing the replicas it lacks."""
        lens, missing = {}, []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                lens[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:  # every rank is tried each round: back off between rounds
            pending_request.routing_context.should_backoff = True
        pinned = kwargs.get("replica_id")
        if pinned is not None:
            match = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            return [match or candidate_replicas]
        key = kwargs.get("routing_key")
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = [by_id[rid] for rid in rendezvous_order(key, by_id)]
        lens = await self._queue_lens(candidate_replicas)
        affine = lens.get(order[0].replica_id)
        if lens and affine is not None and affine - min(lens.values()) > self._imbalanced_threshold:
            return [candidate_replicas]  # imbalanced: the least-loaded replica
        return [order[:1], order[1:]]


# --------------------------------------------------------------------------------------
# The engine replica
# --------------------------------------------------------------------------------------


class EngineReplica:
    """One engine (its own KV cache) behind :func:`refengine.server.api.create_app`.

    Args:
        engine_args: :class:`refengine.engine_args.EngineArgs` fields.
        served_model_name: as ``create_app``'s.
        limits: :class:`refengine.server.api.ServerLimits` fields.
        log_requests: one access line per request (in the replica's log).

    The API key and the body limit are checked at the ingress; the app here is reachable
    only through Ray. The engine loop starts with the first call on the replica's event loop.
    """

    def __init__(self, engine_args: dict, served_model_name: str, limits: dict | None = None,
                 log_requests: bool = True):
        from refengine.core.engine import LLMEngine
        from refengine.engine_args import EngineArgs
        from refengine.server.api import ServerLimits, create_app

        logging.getLogger("refengine").setLevel(logging.INFO)
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_args), setup_runtime=True)
        self.app = create_app(self.engine, served_model_name=served_model_name,
                              limits=ServerLimits(**(limits or {})), log_requests=log_requests)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lifespan = None
        self._start_lock = asyncio.Lock()

    async def _start(self) -> None:
        async with self._start_lock:
            if self._lifespan is None:
                cm = self.app.router.lifespan_context(self.app)  # starts the AsyncEngine loop
                await cm.__aenter__()
                self._lifespan = cm

    async def forward(self, head: dict, body: bytes, routing_key: str | None = None,
                      replica_id: str | None = None):
        """Run one HTTP request through the app; yield ``{"status", "headers"}``, then the
        body's chunks (bytes). ``routing_key`` is the router's; ``replica_id``: the replica
        the caller pinned (404 from any other)."""
        if replica_id is not None and replica_id != self.replica_id:
            message = json.dumps({"error": {"message": f"replica {replica_id!r} is not live", "type":
                                            "not_found_error", "param": "replica", "code": None}}).encode()
            yield {"status": 404, "headers": [("content-type", "application/json"),
                                              (REPLICA_HEADER, self.replica_id)]}
            yield message
            return
        await self._start()
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # the caller went away (or the answer is complete)
            return {"type": "http.disconnect"}

        async def send(message):
            messages.put_nowait(message)

        path = head["path"]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": head["method"], "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": head.get("query", "").encode(), "root_path": "",
                 "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]],
                 "client": ("ray-serve", 0), "server": ("refengine-replica", 0)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:
                    break
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    yield {"status": message["status"], "headers": headers + [(REPLICA_HEADER, self.replica_id)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
        finally:
            gone.set()  # a cancelled stream: the app sees the disconnect and aborts the request

    async def info(self, replica_id: str | None = None) -> dict:
        """``{"replica_id", "pid", "node_id", "block_size", "max_model_len"}`` of this replica."""
        import ray

        await self._start()
        cfg = self.engine.config
        return {"replica_id": self.replica_id, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "block_size": cfg.block_size, "max_model_len": cfg.max_model_len}

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine loop died is replaced."""
        if self._lifespan is not None and not self.app.state.engine_loop.is_running:
            raise RuntimeError("the engine loop has stopped")

    async def __del__(self):
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)


# --------------------------------------------------------------------------------------
# The ingress
# --------------------------------------------------------------------------------------


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s.*)$")


def merge_expositions(texts: dict[str, str], label: str = "replica") -> str:
    """Prometheus text expositions of several replicas as one, each sample labelled
    ``{label}="<replica id>"`` (each family's ``# HELP``/``# TYPE`` once, its samples together).

    Args:
        texts: replica id -> that replica's exposition (the same families, as all run the same code).
    """
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for rid, text in texts.items():
        current = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                head = families.setdefault(current, [])
                if line not in head:
                    head.append(line)
                samples.setdefault(current, [])
                continue
            m = _SAMPLE.match(line)
            if m is None or current is None:
                continue
            name, _, labels, rest = m.groups()
            tag = f'{label}="{rid}"'
            samples[current].append(f"{name}{{{tag}{',' + labels if labels else ''}}}{rest}")
    return "".join("\n".join(families[f] + samples[f]) + "\n" for f in families)


class OpenAIIngress:
    """The HTTP ingress: computes each request's routing key and forwards it to an
    ``EngineReplica`` chosen by :class:`PrefixAffinityRouter`.

    Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (keyed by prompt prefix),
    ``GET /metrics`` (every replica's series with a ``replica`` label; ``?replica=ID``: that
    replica's own exposition), ``GET /replicas`` (the live replicas: id, pid, node), and every
    other path forwarded to the least-loaded replica (``/health``, ``/v1/models``, ``/tokenize``...).

    A request whose replica dies before any of its answer has reached the client is sent
    again (at most :data:`MAX_ATTEMPTS` tries); a non-streamed answer is sent only once
    complete, so it is never cut. A stream cut by a replica's death ends early.
    """

    def __init__(self, replicas, model_dir: str, block_size: int, vocab_size: int, api_key: str | None = None,
                 metrics_auth: bool = True, max_body_bytes: int = 4 * 1024 * 1024,
                 routing_prefix_blocks: int = ROUTING_PREFIX_BLOCKS):
        from refengine.core.engine import load_tokenizer

        self.replicas = replicas
        self.tokenizer = load_tokenizer(Path(model_dir), vocab_size)  # as the engine loads it (None: ids only)
        self.block_size, self.prefix_blocks = block_size, routing_prefix_blocks
        self.api_key, self.metrics_auth, self.max_body_bytes = api_key, metrics_auth, max_body_bytes

    def __serve_build_asgi_app__(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        from refengine.server.api import APIKeyMiddleware, BodyLimitMiddleware

        app = Starlette(routes=[
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/replicas", self.list_replicas, methods=["GET"]),
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/{path:path}", self.other, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
        ])
        app.add_middleware(BodyLimitMiddleware, max_bytes=self.max_body_bytes)
        if self.api_key:
            open_paths = {"/health"} if self.metrics_auth else {"/health", "/metrics"}
            app.add_middleware(APIKeyMiddleware, api_key=self.api_key, open_paths=frozenset(open_paths))
        return app

    # --- routing keys ---------------------------------------------------------------------
    @property
    def head_chars(self) -> int:
        """Characters of text that hold the routing key's tokens: 32 per token (as the
        replicas' ``ServerLimits.max_chars_per_token``), one block to spare for the tokens
        the cut changes."""
        return 32 * (self.prefix_blocks + 1) * self.block_size

    def routing_key(self, path: str, body: bytes) -> str | None:
        """The prompt's :func:`prefix_routing_key` (None for a body the replica will refuse:
        it answers the error). Only a bounded head of the prompt (:attr:`head_chars`, or
        :func:`chat_head` of the messages) is rendered and tokenized: the key needs its
        first blocks, and the replica checks the whole. Call it off the event loop."""
        from refengine.server.protocol import ChatCompletionRequest
        from refengine.server.tool_calls import template_writes_tool_calls

        try:
            req = json.loads(body)
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(req)
                if self.tokenizer is None:
                    return None
                tok = self.tokenizer  # tools go into the prompt as the replica puts them (tool_calls.py)
                tools = chat.tool_calling(native=template_writes_tool_calls(tok.chat_template,
                                                                            tok.chat_template_variables))
                messages, template_kwargs = tools.render(chat.template_messages())
                ids = tok.apply_chat_template(chat_head(messages, self.head_chars),
                                              add_generation_prompt=chat.add_generation_prompt, tokenize=True,
                                              **template_kwargs)
            else:
                prompt = req.get("prompt")
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # a batch: its first prompt
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        return None
                    ids = self.tokenizer.encode(prompt[:self.head_chars], add_special_tokens=True)
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    ids = prompt
                else:
                    return None
            return prefix_routing_key(ids, self.block_size, self.prefix_blocks, req.get("cache_salt"))
        except Exception:  # noqa: BLE001 - a bad body: no key, the replica answers the 400
            return None

    # --- forwarding ---------------------------------------------------------------------
    def _call(self, method: str, stream: bool = False):
        return self.replicas.options(method_name=method, stream=stream)

    async def forward(self, request, routing_key: str | None = None, replica_id: str | None = None):
        from starlette.responses import Response, StreamingResponse

        body = await request.body()
        head = {"method": request.method, "path": request.url.path, "query": request.url.query,
                "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]}
        for attempt in range(1, MAX_ATTEMPTS + 1):
            gen = self._call("forward", stream=True).remote(head, body, routing_key=routing_key,
                                                            replica_id=replica_id)
            try:
                start = await gen.__anext__()
                headers = [(k, v) for k, v in start["headers"] if k.lower() not in ("content-length",
                                                                                  "transfer-encoding")]
                streamed = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                               for k, v in headers)
                if not streamed:  # whole, before the client sees a byte: a death here is retried
                    chunks = [chunk async for chunk in gen]
                    response = Response(b"".join(chunks), status_code=start["status"])
                    response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers] + \
                        [(b"content-length", str(len(response.body)).encode())]
                    return response
                break
            except RayActorError as e:
                logger.warning("replica died before answering (attempt %d of %d): %s", attempt, MAX_ATTEMPTS, e)
                if attempt == MAX_ATTEMPTS:
                    return _error(503, "no engine replica could answer; retry later")

        async def rest():
            try:
                async for chunk in gen:
                    yield chunk
            except RayActorError as e:  # the replica died mid-stream: the stream ends here
                logger.warning("replica died while streaming: %s", e)
            finally:
                gen.cancel()

        response = StreamingResponse(rest(), status_code=start["status"])
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return response

    async def generate(self, request):
        body = await request.body()
        key = await asyncio.to_thread(self.routing_key, request.url.path, body)
        return await self.forward(request, routing_key=key)

    async def other(self, request):
        return await self.forward(request)

    # --- the replicas -------------------------------------------------------------------
    async def live_replicas(self) -> tuple[str, ...]:
        """The replica ids this process's router sees (the router starts with the first call)."""
        if not _LIVE_REPLICAS.get(ENGINE_DEPLOYMENT):
            await self._call("info").remote()
        for _ in range(100):
            if _LIVE_REPLICAS.get(ENGINE_DEPLOYMENT):
                break
            await asyncio.sleep(0.05)
        return _LIVE_REPLICAS.get(ENGINE_DEPLOYMENT, ())

    async def list_replicas(self, request):
        from starlette.responses import JSONResponse

        live = []
        # one call at a time: calls made inside one request share its internal request id,
        # which Ray's router matches routed replicas to pending requests by
        for rid in await self.live_replicas():
            try:
                info = await self._call("info").remote(replica_id=rid)
            except RayActorError:
                continue
            if info["replica_id"] == rid:
                live.append(info)
        return JSONResponse({"object": "list", "data": live})

    async def metrics(self, request):
        from starlette.responses import Response

        pinned = request.query_params.get("replica")
        if pinned is not None:
            return await self.forward(request, replica_id=pinned)
        texts = {}
        for rid in await self.live_replicas():
            try:
                gen = self._call("forward", stream=True).remote(
                    {"method": "GET", "path": "/metrics", "headers": []}, b"", replica_id=rid)
                start = await gen.__anext__()
                chunks = [c async for c in gen]
            except RayActorError:
                continue  # died meanwhile: its series are gone with it
            if start["status"] == 200 and dict(start["headers"]).get(REPLICA_HEADER) == rid:
                texts[rid] = b"".join(chunks).decode()
        return Response(merge_expositions(texts), media_type="text/plain; version=0.0.4; charset=utf-8")


def chat_head(messages: list[dict], max_chars: int) -> list[dict]:
    """The first ``max_chars`` characters of a chat's text (contents and names, in order):
    whole messages while they fit, the next one cut, the rest dropped. Chats that agree on
    that head render to the same first tokens, whatever follows."""
    head, left = [], max_chars
    for m in messages:
        name = m.get("name", "")
        if len(name) > left:
            break
        cut = {**m, "content": m["content"][:left - len(name)]}
        head.append(cut)
        left -= len(name) + len(cut["content"])
        if left == 0:
            break
    return head


def _error(status: int, message: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": "no_replica"}}, status_code=status, headers={"Retry-After": "1"})


# --------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------


def data_parallel_app(engine_args: dict, data_parallel_size: int, *, served_model_name: str | None = None,
                      api_key: str | None = None, metrics_auth: bool = True, limits: dict | None = None,
                      log_requests: bool = True, num_cpus_per_replica: float = 1.0,
                      imbalanced_threshold: float = IMBALANCED_THRESHOLD,
                      routing_prefix_blocks: int = ROUTING_PREFIX_BLOCKS,
                      max_ongoing_requests: int = MAX_ONGOING_REQUESTS):
    """The Ray Serve application: ``OpenAIIngress`` over ``data_parallel_size`` ``EngineReplica``s.

    Args:
        engine_args: :class:`refengine.engine_args.EngineArgs` fields (every replica's engine).
        data_parallel_size: engine replicas (``num_replicas``), >= 1.
        served_model_name: the model name clients send (default: the model directory's name).
        api_key, metrics_auth: as :func:`refengine.server.api.create_app`'s, checked at the ingress.
        limits: :class:`refengine.server.api.ServerLimits` fields (``max_body_bytes`` also at the ingress).
        log_requests: an access line per request in the replicas' logs.
        num_cpus_per_replica: Ray CPUs each engine replica reserves (set the engine's
            ``num_threads`` to match).
        imbalanced_threshold: see :class:`PrefixAffinityRouter`.
        routing_prefix_blocks: KV blocks of prompt hashed into the routing key.
        max_ongoing_requests: requests one replica takes at once (Ray Serve's knob).

    Returns:
        A bound ``ray.serve`` application (``serve.run(app, route_prefix="/")``).

    Raises:
        ValueError: an invalid engine option (before anything is deployed).
    """
    from refengine.engine_args import EngineArgs, default_served_model_name, resolve_model_dir

    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
    args = EngineArgs(**engine_args)
    model_dir = resolve_model_dir(args.model, args.gguf_file).resolve()
    _, model_config = args.model_config()  # FileNotFoundError / ValueError here, not in every replica
    engine_args = {**engine_args, "model": str(model_dir), "gguf_file": None}  # replicas load the resolved path
    name = served_model_name or default_served_model_name(args.model, model_dir)
    limits = dict(limits or {})
    replica = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=data_parallel_size,
        max_ongoing_requests=max_ongoing_requests, ray_actor_options={"num_cpus": num_cpus_per_replica},
        health_check_period_s=5,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs={"imbalanced_threshold": imbalanced_threshold}))
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="OpenAIIngress", num_replicas=1,
                               max_ongoing_requests=4 * max_ongoing_requests, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(engine_args, name, limits, log_requests), str(model_dir), args.block_size,
                        model_config.vocab_size, api_key=api_key, metrics_auth=metrics_auth,
                        max_body_bytes=limits.get("max_body_bytes", 4 * 1024 * 1024),
                        routing_prefix_blocks=routing_prefix_blocks)


def build_app(args: dict):
    """``serve run refengine.server.ray_serve:build_app key=value ...``: ``data_parallel_size``,
    ``served_model_name``, ``api_key``, ``num_cpus_per_replica``, ``imbalanced_threshold``,
    ``routing_prefix_blocks`` and any :class:`refengine.engine_args.EngineArgs` field
    (values as strings from the command line, or typed from a config file's ``args``)."""
    import dataclasses

    from refengine.engine_args import EngineArgs

    args = dict(args)
    own = {"data_parallel_size": int, "served_model_name": str, "api_key": str, "num_cpus_per_replica": float,
           "imbalanced_threshold": float, "routing_prefix_blocks": int}
    options = {k: conv(args.pop(k)) for k, conv in own.items() if k in args}
    types = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    engine_args = {}
    for k, v in args.items():
        if isinstance(v, str) and k in types and types[k] not in ("str", "str | None"):
            v = json.loads(v.lower() if v.lower() in ("true", "false") else v)  # numbers, booleans, JSON objects
        engine_args[k] = v
    return data_parallel_app(engine_args, options.pop("data_parallel_size", 2), **options)


def run_data_parallel(app, *, host: str, port: int) -> None:
    """Deploy ``app`` (:func:`data_parallel_app`) on the Ray cluster at ``$RAY_ADDRESS``, or a
    local one started here, serve it on ``host:port`` and block until Ctrl-C or SIGTERM, then
    shut the application (and a local cluster) down."""
    import signal
    import time

    import ray

    def stop(signum, frame):
        raise KeyboardInterrupt

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    # after ray.init, whose core worker installs its own: `docker stop` shuts down as Ctrl-C does
    signal.signal(signal.SIGTERM, stop)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if os.environ.get("RAY_ADDRESS"):
            serve.delete(APP_NAME)  # a shared cluster: only this application
        else:
            serve.shutdown()
        ray.shutdown()
