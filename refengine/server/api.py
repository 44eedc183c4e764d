"""The OpenAI-compatible HTTP API over one engine (FastAPI).

Endpoints (vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``POST /tokenize``, ``POST /detokenize``. Streaming is server-sent events:
``data: {chunk}`` per delta, ``data: [DONE]`` last.

Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:

====  =====================================================================================
400   an invalid field, a prompt too long for ``max_model_len`` (the message gives both
      numbers), an unsupported OpenAI field, malformed JSON
401   ``/v1/*`` without the right ``Authorization: Bearer KEY`` (when a key is set)
404   an unknown model name or path
413   a body over ``ServerLimits.max_body_bytes``
503   the engine's waiting queue is at ``ServerLimits.max_waiting_requests`` (retry later)
500   only for the server's own faults (an engine step that raised)
====  =====================================================================================

A client that disconnects, streaming or not, has its request aborted; its KV blocks are
free after at most the engine step that was running. Each request logs one access line
(``refengine.server`` logger, INFO): status, token counts, TTFT and end-to-end time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from dataclasses import dataclass

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from refengine.engine import PromptTooLongError
from refengine.sampling_params import SamplingParams
from refengine.sequence import CompletionOutput
from refengine.server.engine_loop import AsyncEngine, EngineStepError, Overloaded, RequestStream
from refengine.server.protocol import (ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, CompletionChoice,
                                       CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                                       DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard,
                                       ModelList, ResponseMessage, TokenizeRequest, TokenizeResponse, TokenLogprob,
                                       TopLogprob, UsageInfo)

logger = logging.getLogger("refengine.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass
class ServerLimits:
    """Bounds on what one client can ask for.

    Attributes:
        max_body_bytes: largest request body, bytes (413 above).
        max_n: largest ``n`` (400 above). (``logprobs`` / ``top_logprobs`` are bounded by the
            engine's ``max_logprobs``, ``LLMEngine.check_sampling_params``.)
        max_waiting_requests: sequences allowed to wait for a first schedule; new
            requests get 503 while the queue is at this bound.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    max_waiting_requests: int = 1024


class APIError(Exception):
    """An error answered with OpenAI's error body (``type`` defaults by status)."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type or ERROR_TYPES.get(status, "server_error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: also when the
    client leaves before the body generator has started (its ``finally`` would not run)."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close):
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(payload) -> str:
    """One server-sent event carrying a pydantic model (or the ``[DONE]`` marker)."""
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


# --------------------------------------------------------------------------------------
# Middleware (plain ASGI, so they see every request, errors included)
# --------------------------------------------------------------------------------------


@dataclass
class AccessRecord:
    """What one request's access line reports; handlers fill in the token figures."""

    start: float
    request_id: str = "-"
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    first_token: float | None = None

    def line(self, method: str, path: str, status: int) -> str:
        def ms(t):
            return "-" if t is None else f"{(t - self.start) * 1e3:.1f}ms"

        return (f"{method} {path} {status} id={self.request_id} prompt_tokens={self.prompt_tokens} "
                f"output_tokens={self.output_tokens} ttft={ms(self.first_token)} e2e={ms(time.monotonic())}")


class AccessLogMiddleware:
    """One log line per request, written when its response (or stream) has ended."""

    def __init__(self, app, enabled: bool = True):
        self.app, self.enabled = app, enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord(start=time.monotonic())
        scope.setdefault("state", {})["access"] = record
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if self.enabled:
                logger.info(record.line(scope["method"], scope["path"], status))


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: by its Content-Length up front, or while reading."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than the server's limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, message, code="request_too_large")(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:  # a chunked body: FastAPI re-raises HTTPException
                    raise StarletteHTTPException(413, message)
            return msg

        await self.app(scope, limited_receive, send)


class APIKeyMiddleware:
    """401 for ``/v1/*`` requests without ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                return await error_response(401, "missing or incorrect API key (Authorization: Bearer KEY)",
                                            code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------
# The endpoints' logic
# --------------------------------------------------------------------------------------


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone (call once the body has been read)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


def access_record(request: Request) -> AccessRecord:
    return getattr(request.state, "access", None) or AccessRecord(start=time.monotonic())


def param_of(error: ValueError) -> str | None:
    """The field a ``SamplingParams`` error names (``SamplingParams.top_p=...``)."""
    m = re.match(r"SamplingParams\.(\w+)=", str(error))
    return m.group(1) if m else None


def bad_request(error: ValueError, param: str | None = None, renames: dict[str, str] | None = None) -> APIError:
    """The 400 for a ``ValueError`` of ``SamplingParams`` or the engine's checks: its message
    as is; ``param`` the field the message names (``renames`` maps it to the request's
    name), else ``param``; a too-long prompt is ``context_length_exceeded``."""
    named = param_of(error)
    code = "context_length_exceeded" if isinstance(error, PromptTooLongError) else None
    return APIError(400, str(error), param=(renames or {}).get(named, named) or param, code=code)


@dataclass
class ChoicePart:
    """What one response carries of one choice (all of it, or streaming: what is new), which
    each endpoint's ``choice`` function shapes into its choice object."""

    tag: int  # the prompt's index in the request
    index: int  # the choice's index in the response: tag * n + the completion's index
    output: CompletionOutput  # the engine's completion (finish_reason, stop_reason)
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # of token_ids; None unless asked
    text_offset: int = 0  # characters of the choice's text sent before this part
    first: bool = True  # the choice's first part


class OpenAIServing:
    """The completions, chat, tokenize and models logic over one :class:`AsyncEngine`."""

    def __init__(self, engine_loop: AsyncEngine, served_model_name: str, limits: ServerLimits):
        self.loop = engine_loop
        self.engine = engine_loop.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = served_model_name
        self.limits = limits
        self.max_model_len = self.engine.config.max_model_len

    # --- checks -------------------------------------------------------------------------
    # What the engine can serve (prompt length and vocabulary, n, logprobs, stop token ids,
    # the SamplingParams ranges) is the engine's to say: the handlers call its own checks
    # (read-only, on its frozen config, so safe while a step runs) and turn their
    # ValueError into a 400 before the request queues. Only the server's rules are here.
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer and {self.engine.model_dir} has none "
                                "(send prompts as token ids)", param="prompt")
        return self.tokenizer

    def check_request(self, req) -> None:
        self.check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0])
        # The server's own bound per client (ServerLimits.max_n), not the engine's max_num_seqs,
        # which the engine checks itself: it must refuse before n sequences are queued.
        if req.n is not None and req.n > self.limits.max_n:
            raise APIError(400, f"n={req.n} is above the server's limit of {self.limits.max_n}", param="n")

    def engine_prompts(self, prompts: list, param: str) -> list[list[int]]:
        """Each prompt's token ids as the engine reads and checks them
        (``LLMEngine.prompt_token_ids``: text tokenized with the special tokens the engine
        adds; empty, out-of-vocabulary and too-long prompts refused with a 400 on ``param``)."""
        try:
            return [self.engine.prompt_token_ids(p)[1] for p in prompts]
        except ValueError as e:
            raise bad_request(e, param) from None

    def max_tokens(self, prompts: list[list[int]], requested: int | None, explicit: bool,
                   default: int | None, param: str) -> int | None:
        """The ``max_tokens`` to run with (None: until ``max_model_len``) after prompts the
        engine has accepted (each shorter than ``max_model_len``).

        The server's rule, not the engine's: the engine runs a ``max_tokens`` past
        ``max_model_len`` to that length (finish "length"); OpenAI's API refuses it.

        Raises:
            APIError: 400 when an explicit ``requested`` (named ``param``) does not fit after
                the longest prompt.
        """
        limit = self.max_model_len
        longest = max(len(p) for p in prompts)
        if explicit and requested is not None:
            if requested >= 1 and longest + requested > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens, but {longest + requested} "
                                    f"were requested ({longest} in the prompt, {requested} for the completion)",
                               param=param, code="context_length_exceeded")
            return requested
        return None if default is None else min(default, limit - longest)

    def sampling_params(self, req, max_tokens, logprobs, renames: dict[str, str] | None = None) -> SamplingParams:
        """``req``'s ``SamplingParams``, checked by ``SamplingParams`` and the engine
        (``LLMEngine.check_sampling_params``); ``renames``: see :func:`bad_request`."""
        try:
            params = req.sampling_params(max_tokens, logprobs)
            self.engine.check_sampling_params(params)
        except ValueError as e:
            raise bad_request(e, renames=renames) from None
        return params

    async def submit(self, request_id: str, prompts: list[list[int]], params) -> RequestStream:
        if len(prompts) * params.n > self.limits.max_waiting_requests:  # would be refused forever
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} sequences is above the server's limit of "
                                f"{self.limits.max_waiting_requests} per request", param="prompt")
        try:
            return await self.loop.submit(request_id, prompts, params)
        except Overloaded as e:
            raise APIError(503, str(e), type="server_error", code="overloaded") from None
        except ValueError as e:  # what only add_request checks (e.g. stop strings without a tokenizer)
            raise bad_request(e, "prompt") from None

    # --- prompts ------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        tok = self.require_tokenizer("chat")
        try:  # the template writes its own special tokens
            return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # a template's raise_exception (e.g. role order) is the input's fault
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None

    # --- logprobs -----------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int = 0
                            ) -> CompletionLogprobs:
        """OpenAI's legacy object; ``top_logprobs`` holds the sampled token and the top k."""
        out = CompletionLogprobs()
        for tid, lps in zip(token_ids, logprobs):
            text = self.token_text(tid)
            out.tokens.append(text)
            out.token_logprobs.append(max(lps[tid], MIN_LOGPROB))
            out.top_logprobs.append({self.token_text(t): max(lp, MIN_LOGPROB) for t, lp in lps.items()})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> ChatLogprobs:
        """Chat's object; ``top_logprobs`` holds the ``top`` most likely tokens."""
        content = []
        for tid, lps in zip(token_ids, logprobs):
            best = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
            content.append(TokenLogprob(
                **self._top(tid, lps[tid]),
                top_logprobs=[TopLogprob(**self._top(t, lp)) for t, lp in best]))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}

    # --- running a request ----------------------------------------------------------------
    async def collect(self, stream: RequestStream, request: Request, record: AccessRecord) -> dict:
        """Final output per prompt index; aborts the request if the client goes away.

        Raises:
            APIError: 499 when the client disconnected (nobody reads it; it is logged).
        """
        finals = {}

        async def consume():
            async for tag, out in stream:
                if record.first_token is None:
                    record.first_token = time.monotonic()
                finals[tag] = out

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (consumer, watcher):
                task.cancel()
            stream.close()
        if not consumer.done() or consumer.cancelled():
            raise APIError(499, "the client closed the connection")
        if isinstance(consumer.exception(), EngineStepError):
            raise APIError(500, str(consumer.exception()), type="server_error")
        consumer.result()
        return finals

    @staticmethod
    def usage(prompts: list[list[int]], finals: dict) -> UsageInfo:
        p = sum(len(x) for x in prompts)
        c = sum(len(o.token_ids) for out in finals.values() for o in out.outputs)
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    async def generate(self, req, request: Request, request_id: str, prompts: list[list[int]], params, *,
                       choice, response, chunk, head=()):
        """Run a request and answer it, streamed or not: what both endpoints share.

        Args:
            req: the request body (``stream``, ``include_usage``).
            request: the HTTP request (its disconnect aborts a non-streamed request).
            request_id: the response's ``id``.
            prompts: token ids per prompt; choice ``i`` of prompt ``tag`` is ``tag * n + i``.
            params: the engine's sampling parameters.
            choice: ``(ChoicePart, streamed) ->`` the endpoint's choice object.
            response: ``(choices, usage) ->`` the non-streamed body.
            chunk: ``(choices, usage) ->`` one streamed chunk (usage None but in the last).
            head: chunks streamed before any delta (built lazily, as they are sent).
        """
        record = access_record(request)
        record.request_id, record.prompt_tokens = request_id, sum(len(p) for p in prompts)
        stream = await self.submit(request_id, prompts, params)
        if req.stream:
            events = self.events(stream, prompts, params.n, record, choice, chunk, head, req.include_usage)
            return EventStreamResponse(events, on_close=stream.close)
        finals = await self.collect(stream, request, record)
        parts = [ChoicePart(tag, tag * params.n + c.index, c, c.text, c.token_ids, c.logprobs)
                 for tag, out in sorted(finals.items()) for c in out.outputs]
        usage = self.usage(prompts, finals)
        record.output_tokens = usage.completion_tokens
        return response([choice(p, False) for p in sorted(parts, key=lambda p: p.index)], usage)

    async def events(self, stream: RequestStream, prompts: list[list[int]], n: int, record: AccessRecord,
                     choice, chunk, head, include_usage: bool):
        """The server-sent events of :meth:`generate`: ``head``, one chunk per choice that
        advanced (its new text, token ids and logprobs), the usage chunk if asked, ``[DONE]``."""
        finals, sent_text, finished = {}, {}, set()
        try:
            for event in head:
                yield sse(event)
            async for tag, out in stream:
                finals[tag] = out
                for c in out.outputs:
                    index = tag * n + c.index
                    if index in finished or not (c.delta_token_ids or c.delta_text or c.finish_reason):
                        continue
                    if record.first_token is None:
                        record.first_token = time.monotonic()
                    new = c.delta_token_ids
                    logprobs = None if c.logprobs is None else c.logprobs[len(c.token_ids) - len(new):]
                    part = ChoicePart(tag, index, c, c.delta_text, new, logprobs,
                                      text_offset=sent_text.get(index, 0), first=index not in sent_text)
                    sent_text[index] = part.text_offset + len(c.delta_text)
                    if c.finish_reason is not None:
                        finished.add(index)
                    yield sse(chunk([choice(part, True)], None))
            if include_usage:
                yield sse(chunk([], self.usage(prompts, finals)))
        except EngineStepError as e:
            yield sse(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error")))
        finally:
            stream.close()
            record.output_tokens = self.usage(prompts, finals).completion_tokens  # also when cut short
        yield sse("[DONE]")

    # --- /v1/completions ------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, request: Request):
        self.check_request(req)
        prompt = req.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            prompt = [prompt]  # one prompt ([] is an empty one, which the engine refuses)
        prompts = self.engine_prompts(prompt, "prompt")
        max_tokens = self.max_tokens(prompts, req.max_tokens, "max_tokens" in req.model_fields_set,
                                     default=16, param="max_tokens")
        params = self.sampling_params(req, max_tokens, req.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"

        def choice(part: ChoicePart, streamed: bool) -> CompletionChoice:
            return CompletionChoice(
                index=part.index, text=part.text, finish_reason=part.output.finish_reason,
                stop_reason=part.output.stop_reason,
                logprobs=self.completion_logprobs(part.token_ids, part.logprobs, offset=part.text_offset)
                if req.logprobs is not None else None,
                prompt_token_ids=prompts[part.tag] if req.return_token_ids and part.first else None,
                token_ids=list(part.token_ids) if req.return_token_ids else None)

        def body(choices, usage) -> CompletionResponse:  # streamed chunks have the same shape
            return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

        return await self.generate(req, request, request_id, prompts, params, choice=choice, response=body,
                                   chunk=body)

    # --- /v1/chat/completions -------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, request: Request):
        self.check_request(req)
        [prompt] = self.engine_prompts([self.chat_prompt(req.template_messages(), req.add_generation_prompt)],
                                       "messages")
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        max_tokens = self.max_tokens([prompt], requested, requested is not None, default=None, param=param)
        top = req.top_logprobs or 0
        params = self.sampling_params(req, max_tokens, top if req.logprobs else None,
                                      renames={"logprobs": "top_logprobs"})  # the engine's logprobs is chat's top
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def choice(part: ChoicePart, streamed: bool) -> ChatStreamChoice | ChatCompletionChoice:
            text = {"delta": DeltaMessage(content=part.text)} if streamed else \
                {"message": ResponseMessage(content=part.text)}
            return (ChatStreamChoice if streamed else ChatCompletionChoice)(
                index=part.index, **text, finish_reason=part.output.finish_reason,
                stop_reason=part.output.stop_reason,
                logprobs=self.chat_logprobs(part.token_ids, part.logprobs, top) if req.logprobs else None,
                token_ids=list(part.token_ids) if req.return_token_ids else None)

        def response(choices, usage) -> ChatCompletionResponse:
            return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage,
                                          prompt_token_ids=prompt if req.return_token_ids else None)

        def chunk(choices, usage, prompt_token_ids=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=choices, usage=usage,
                                       prompt_token_ids=prompt_token_ids)

        # the first chunk of each choice carries the role, as OpenAI's does
        head = (chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], None,
                      prompt_token_ids=prompt if req.return_token_ids and i == 0 else None) for i in range(params.n))
        return await self.generate(req, request, request_id, [prompt], params, choice=choice, response=response,
                                   chunk=chunk, head=head)

    # --- the small endpoints --------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=str(self.engine.model_dir),
                                         max_model_len=self.max_model_len)])

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = self.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages],
                                   req.add_generation_prompt)
        else:
            ids = self.require_tokenizer("tokenize").encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        tok = self.require_tokenizer("detokenize")
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


def create_app(engine, *, served_model_name: str, api_key: str | None = None,
               limits: ServerLimits | None = None, log_requests: bool = True) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``LLMEngine`` nothing else may use meanwhile).

    The engine loop starts with the app (its lifespan) and stops with it; run the app with
    uvicorn (``uvicorn.run(app, host=..., port=...)``).

    Args:
        engine: the ``LLMEngine``.
        served_model_name: the name ``/v1/models`` lists and requests' ``model`` must match.
        api_key: when set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>``.
        limits: see :class:`ServerLimits`.
        log_requests: write one access line per request.
    """
    limits = limits or ServerLimits()
    engine_loop = AsyncEngine(engine, max_waiting_requests=limits.max_waiting_requests)
    serving = OpenAIServing(engine_loop, served_model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        try:
            yield
        finally:
            await engine_loop.stop()

    app = FastAPI(title="refengine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = engine_loop
    app.state.serving = serving
    # added last = outermost: the access log sees the 401s and 413s too
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    app.add_middleware(AccessLogMiddleware, enabled=log_requests)

    @app.exception_handler(APIError)
    async def on_api_error(request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return error_response(e.status, e.message, e.type, e.param, e.code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), code="request_too_large" if e.status_code == 413 else None)

    @app.exception_handler(Exception)
    async def on_crash(request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}", "server_error")

    @app.get("/health")
    async def health():
        """200 while the engine loop runs, else 503."""
        if not engine_loop.is_running:
            return error_response(503, "the engine loop is not running", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serving.create_completion(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serving.create_chat_completion(req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return serving.detokenize(req)

    return app
