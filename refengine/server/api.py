"""The OpenAI-compatible HTTP API over one engine (FastAPI).

Endpoints (vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``POST /tokenize``, ``POST /detokenize``. Streaming is server-sent events:
``data: {chunk}`` per delta, ``data: [DONE]`` last.

Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:

====  =====================================================================================
400   an invalid field, a prompt too long for ``max_model_len`` (the message gives both
      numbers), an unsupported OpenAI field, malformed JSON, a list or text over its
      bound (:class:`ServerLimits`: ``stop``, ``stop_token_ids``, ``bad_words``, structured
      outputs, ``tools``; ``allowed_token_ids`` longer than the vocabulary), a bad tool
      definition
401   any route but ``/health`` (and ``/metrics`` with ``metrics_auth=False``) without the
      right ``Authorization: Bearer KEY``, when a key is set
404   an unknown model name or path
413   a body over ``ServerLimits.max_body_bytes``
503   the engine's waiting queue is at ``ServerLimits.max_waiting_requests`` (retry later),
      or the engine loop has stopped (``/health`` answers 503 too)
500   only for the server's own faults (an engine step that raised): the message is
      "internal error" and a request id; the traceback is logged under that id
====  =====================================================================================

Text is tokenized (and chat templates rendered) in a worker thread, after a size check
(``ServerLimits.max_chars_per_token``): a multi-megabyte prompt neither blocks the event
loop nor costs a tokenizer pass before it is refused. The same holds for every request
check that touches the tokenizer, a grammar or a list: each list is bounded first (on the
event loop, by its length), then ``SamplingParams`` are built and checked in a worker
thread, where bad_words are tokenized and grammars compiled; what that builds (bad-word
token sequences, the allowed_token_ids mask, the grammar's first matcher) is kept on the
params, so the engine's own check when the request is added, on the event loop, is O(1).
llguidance's tokenizer, whose build holds the GIL, is built before the server serves.

A client that disconnects, streaming or not, has its request aborted; its KV blocks are
free after at most the engine step that was running. Each request logs one access line
(``refengine.server`` logger, INFO): status, token counts, TTFT and end-to-end time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
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

from refengine.core.engine import PromptTooLongError
from refengine.lora import LoRARequest
from refengine.core.sequence import CompletionOutput, Logprob
from refengine.sampling_params import RequestOutputKind, SamplingParams
from refengine.server.engine_loop import (AsyncEngine, EngineDeadError, EngineStepError, MergedOutput, Overloaded,
                                          RequestStream)
from refengine.server.protocol import (ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, CompletionChoice,
                                       CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaFunctionCall,
                                       DeltaMessage, DeltaToolCall, DetokenizeRequest, DetokenizeResponse, ErrorInfo,
                                       ErrorResponse, FunctionCallResponse, ModelCard, ModelList, ResponseMessage,
                                       TokenizeRequest, TokenizeResponse, TokenLogprob, ToolCall, TopLogprob,
                                       UsageInfo)
from refengine.server.tool_calls import (ToolCalling, ToolCallStream, ToolsError, check_tools, parse_tool_calls,
                                         template_writes_tool_calls)

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
        max_stop_strings: most ``stop`` strings per request (OpenAI allows 4, vLLM has no
            bound; each is searched for after every token).
        max_stop_string_chars: longest ``stop`` string, characters.
        max_stop_token_ids: most ``stop_token_ids`` per request.
        max_chars_per_token: a text prompt (or chat messages' text) over ``max_model_len *
            max_chars_per_token`` characters is refused before it is tokenized: it could fit
            only if its tokens averaged more characters than that (real vocabularies' longest
            tokens, runs of spaces, are a few dozen).
        max_tokenize_chars: the same bound for ``/tokenize``, whose text need not fit
            ``max_model_len`` (counting the tokens of a long text is what it is for;
            ``refengine bench serve`` tokenizes its 40 kB corpus there).
        max_bad_words: most ``bad_words`` per request (vLLM has no bound; each word is
            tokenized twice and matched against the output every step).
        max_bad_word_chars: longest ``bad_words`` entry, characters.
        max_structured_output_choices: most choices of ``guided_choice`` (or
            ``structured_outputs.choice``): OpenAI's bound on a schema's enum values
            (1000). Compiling a choice grammar grows faster than its size.
        max_structured_output_chars: largest structured-output field (``response_format``,
            ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
            ``structured_outputs``), characters of its text (a schema or a list as JSON),
            checked before it is compiled.
        max_tools: most ``tools`` per chat request (OpenAI's bound on functions, 128).
        max_tools_chars: largest ``tools``, characters of its JSON text, checked before any
            schema is checked or compiled (the tools are part of the prompt too, and count
            towards ``max_chars_per_token``'s bound).

    ``allowed_token_ids`` is bounded by the engine: at most the vocabulary's size.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    max_waiting_requests: int = 1024
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_chars_per_token: int = 32
    max_tokenize_chars: int = 1024 * 1024
    max_bad_words: int = 256
    max_bad_word_chars: int = 256
    max_structured_output_choices: int = 1000
    max_structured_output_chars: int = 64 * 1024
    max_tools: int = 128
    max_tools_chars: int = 64 * 1024


class APIError(Exception):
    """An error answered with OpenAI's error body (``type`` defaults by status)."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


def internal_error(request_id: str | None = None) -> APIError:
    """The 500 a client sees for the server's own fault: no internal detail, only an id to
    find the logged traceback by."""
    request_id = request_id or f"req-{uuid.uuid4().hex}"
    return APIError(500, f"internal error (request id {request_id})", type="server_error", code="internal_error")


def error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type or ERROR_TYPES.get(status, "server_error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: also when the
    client leaves before the body generator has started (its ``finally`` would not run).
    ``Cache-Control: no-cache`` and ``X-Accel-Buffering: no`` tell caches and reverse
    proxies (nginx) to pass each event on as it comes."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
    """401 for requests without ``Authorization: Bearer <key>``: every path but those in
    ``open_paths`` (``/health``, so that a load balancer's probe needs no key)."""

    def __init__(self, app, api_key: str, open_paths: frozenset = frozenset({"/health"})):
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
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
    prompt_logprobs: list | None = None  # the request's RequestOutput.prompt_logprobs (echo), on a first part


class OpenAIServing:
    """The completions, chat, tokenize and models logic over one :class:`AsyncEngine`."""

    def __init__(self, engine_loop: AsyncEngine, served_model_name: str, limits: ServerLimits,
                 lora_modules: dict[str, str] | None = None):
        self.loop = engine_loop
        self.engine = engine_loop.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = served_model_name
        #: name -> LoRARequest of each adapter a request's ``model`` may name (ids 1, 2, ... in order)
        self.lora_requests = {name: LoRARequest(name, i, str(path))
                              for i, (name, path) in enumerate((lora_modules or {}).items(), 1)}
        self.limits = limits
        self.max_model_len = self.engine.config.max_model_len
        # whether the chat template takes `tools` itself (else tools get the generic format)
        self.native_tools = self.tokenizer is not None and template_writes_tool_calls(
            self.tokenizer.chat_template, self.tokenizer.chat_template_variables)

    # --- checks -------------------------------------------------------------------------
    # What the engine can serve (prompt length and vocabulary, n, logprobs, stop token ids,
    # the SamplingParams ranges) is the engine's to say: the handlers call its own checks
    # (read-only, on its frozen config, so safe while a step runs) and turn their
    # ValueError into a 400 before the request queues. Only the server's rules are here.
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter the request's ``model`` names (vLLM's ``--lora-modules``), None for the base model.

        Raises:
            APIError: 404 for a name this server does not serve (the message lists them).
        """
        if name is None or name == self.model_name:
            return None
        lora = self.lora_requests.get(name)
        if lora is None:
            served = ", ".join(repr(n) for n in [self.model_name, *self.lora_requests])
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return lora

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer and {self.engine.model_dir} has none "
                                "(send prompts as token ids)", param="prompt")
        return self.tokenizer

    def check_request(self, req) -> LoRARequest | None:
        """The request's adapter (:meth:`check_model`), after the fields this server refuses."""
        lora = self.check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0])
        # The server's own bound per client (ServerLimits.max_n), not the engine's max_num_seqs,
        # which the engine checks itself: it must refuse before n sequences are queued.
        if req.n is not None and req.n > self.limits.max_n:
            raise APIError(400, f"n={req.n} is above the server's limit of {self.limits.max_n}", param="n")
        self.check_stops(req.stop, req.stop_token_ids)
        self.check_token_lists(req.bad_words, req.allowed_token_ids)
        if req.cache_salt is not None and not req.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string when given", param="cache_salt")
        return lora

    def check_stops(self, stop, stop_token_ids) -> None:
        """The server's bounds on stop conditions (:class:`ServerLimits`); each is checked
        after every generated token."""
        lim = self.limits
        strings = [stop] if isinstance(stop, str) else stop or []
        _check_text_list(strings, "stop", ("stop strings", "stop string"), lim.max_stop_strings,
                         lim.max_stop_string_chars)
        if stop_token_ids is not None and len(stop_token_ids) > lim.max_stop_token_ids:
            raise APIError(400, f"{len(stop_token_ids)} stop_token_ids is above the server's limit of "
                                f"{lim.max_stop_token_ids}", param="stop_token_ids")

    def check_token_lists(self, bad_words, allowed_token_ids) -> None:
        """The bounds on ``bad_words`` (:class:`ServerLimits`) and ``allowed_token_ids`` (the
        vocabulary's size), by length: cheap enough for the event loop, and checked before
        any word is tokenized or any id read."""
        lim = self.limits
        if bad_words is not None:
            _check_text_list(bad_words, "bad_words", ("bad_words", "bad word"), lim.max_bad_words,
                             lim.max_bad_word_chars)
        vocab = self.engine.model_config.vocab_size
        if allowed_token_ids is not None and len(allowed_token_ids) > vocab:
            raise APIError(400, f"{len(allowed_token_ids)} allowed_token_ids is above the vocabulary's size of {vocab}",
                           param="allowed_token_ids")

    def check_structured_outputs_size(self, req) -> None:
        """The bounds on a structured output (:class:`ServerLimits`), before it is compiled:
        the number of choices, then the field's size (a string's length; a schema's or a
        list's JSON text, so run it off the event loop)."""
        lim = self.limits
        for name in req.structured_outputs_fields():
            value = getattr(req, name)
            choices = value if name == "guided_choice" else None
            if name == "structured_outputs":  # a dict, vLLM's {"choice": [...], ...}
                choices = value.get("choice")
            if isinstance(choices, list) and len(choices) > lim.max_structured_output_choices:
                raise APIError(400, f"{len(choices)} choices is above the server's limit of "
                                    f"{lim.max_structured_output_choices}", param=name)
            size, unit = (len(value), "") if isinstance(value, str) else \
                (len(json.dumps(value, ensure_ascii=False)), " (as JSON)")
            if size > lim.max_structured_output_chars:
                raise APIError(400, f"{name} of {size} characters{unit} is above the server's limit of "
                                    f"{lim.max_structured_output_chars}", param=name)

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.limits.max_chars_per_token

    def check_text_size(self, num_chars: int, param: str, for_tokenize: bool = False) -> None:
        """Refuse text too long to fit ``max_model_len`` before tokenizing it (see
        ``ServerLimits.max_chars_per_token``; ``for_tokenize``: ``max_tokenize_chars``)."""
        if for_tokenize:
            limit, why = self.limits.max_tokenize_chars, "the server's /tokenize limit"
        else:
            limit = self.max_prompt_chars
            why = f"max_model_len {self.max_model_len} x {self.limits.max_chars_per_token} characters per token"
        if num_chars > limit:
            raise APIError(400, f"the text has {num_chars} characters; this server tokenizes at most {limit} ({why})",
                           param=param, code="context_length_exceeded")

    def check_messages(self, messages: list, param: str = "messages", for_tokenize: bool = False) -> None:
        """400 for no messages, a non-assistant message without content, or text over the
        size limit."""
        if not messages:
            raise APIError(400, "messages must hold at least one message", param=param)
        for i, m in enumerate(messages):
            if m.content is None and m.role != "assistant":
                raise APIError(400, f"messages[{i}] (role '{m.role}') has no content", param=param)
        self.check_text_size(sum(m.num_chars() for m in messages), param, for_tokenize)

    def prepare_tools(self, req: ChatCompletionRequest, tools: ToolCalling):
        """The checks of ``tools`` (:class:`ServerLimits`' bounds first, then
        :func:`~refengine.server.tool_calls.check_tools`), and the grammar a forced
        ``tool_choice`` decodes with (a ``StructuredOutputsParams``, or None). Run it off the
        event loop: it reads the tools' JSON, checks their schemas and compiles a grammar.

        Raises:
            APIError: 400 naming ``tools`` (or the field at fault): over a bound, a bad
                schema, a schema llguidance cannot compile.
        """
        from refengine.structured_output import StructuredOutputsParams

        if not tools.functions:
            return None
        lim = self.limits
        size = len(json.dumps(tools.functions, ensure_ascii=False))
        if size > lim.max_tools_chars:
            raise APIError(400, f"tools of {size} characters (as JSON) is above the server's limit of "
                                f"{lim.max_tools_chars}", param="tools")
        # the tools are rendered into the prompt: they count towards its size bound
        self.check_text_size(size + sum(m.num_chars() for m in req.messages), "messages")
        try:
            check_tools(tools.functions)
            grammar = tools.grammar()
            return None if grammar is None else StructuredOutputsParams(grammar=grammar)
        except ToolsError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:  # llguidance refused a schema
            raise APIError(400, f"tools: a schema cannot be enforced: {e}", param="tools") from None

    async def engine_prompts(self, prompts: list, param: str) -> list[list[int]]:
        """Each prompt's token ids as the engine reads and checks them
        (``LLMEngine.prompt_token_ids``: text tokenized with the special tokens the engine
        adds; empty, out-of-vocabulary and too-long prompts refused with a 400 on ``param``).
        Text is size-checked first, then tokenized in a worker thread (off the event loop)."""
        for p in prompts:
            if isinstance(p, str):
                self.check_text_size(len(p), param)

        def run():  # token-id prompts too: the engine reads every id of a list the body bounds
            return [self.engine.prompt_token_ids(p)[1] for p in prompts]

        try:
            return await asyncio.to_thread(run)
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

    async def sampling_params(self, req, max_tokens, logprobs, renames: dict[str, str] | None = None,
                              **overrides) -> SamplingParams:
        """``req``'s ``SamplingParams`` (and ``overrides``, e.g. ``prompt_logprobs``), checked
        by the structured-output bounds, ``SamplingParams`` and the engine
        (``LLMEngine.check_sampling_params``) in a worker thread: bad_words are tokenized and
        a grammar compiled there, and kept on the params for the engine's own check and
        steps (so nothing may copy the params afterwards). ``renames``: see :func:`bad_request`."""
        def build() -> SamplingParams:
            self.check_structured_outputs_size(req)
            # only what is new each step: a long output costs O(new tokens) per step, not O(length)
            params = req.sampling_params(max_tokens, logprobs, output_kind=RequestOutputKind.DELTA, **overrides)
            self.engine.check_sampling_params(params)
            return params

        try:
            return await asyncio.to_thread(build)
        except ValueError as e:
            fields = req.structured_outputs_fields()  # the grammar's errors name the field the request used
            if fields:
                renames = {**(renames or {}), "structured_outputs": fields[0]}
            raise bad_request(e, renames=renames) from None

    async def submit(self, request_id: str, prompts: list[list[int]], params, cache_salt: str | None = None,
                     lora_request: LoRARequest | None = None) -> RequestStream:
        if len(prompts) * params.n > self.limits.max_waiting_requests:  # would be refused forever
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} sequences is above the server's limit of "
                                f"{self.limits.max_waiting_requests} per request", param="prompt")
        try:
            return await self.loop.submit(request_id, prompts, params, cache_salt=cache_salt,
                                          lora_request=lora_request)
        except Overloaded as e:
            raise APIError(503, str(e), type="server_error", code="overloaded") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        except EngineStepError:  # logged by the engine loop
            raise internal_error(request_id) from None
        except ValueError as e:  # what only add_request checks (e.g. stop strings without a tokenizer)
            raise bad_request(e, "prompt") from None

    # --- prompts ------------------------------------------------------------------------
    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, **template_kwargs) -> list[int]:
        """The rendered and tokenized chat (in a worker thread: templates and tokenizers
        take time on long inputs; :meth:`check_messages` has bounded their size).
        ``template_kwargs``: more template variables (``tools``)."""
        tok = self.require_tokenizer("chat")
        try:  # the template writes its own special tokens
            return await asyncio.to_thread(tok.apply_chat_template, messages,
                                           add_generation_prompt=add_generation_prompt, tokenize=True,
                                           **template_kwargs)
        except Exception as e:  # a template's raise_exception (e.g. role order) is the input's fault
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None

    def echo_text(self, prompt, token_ids: list[int]) -> str:
        """The text ``echo`` puts first: a text prompt as given; a token-id prompt decoded
        (special tokens kept), as vLLM's; "" without a tokenizer."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    # --- logprobs -----------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict | None], offset: int = 0
                            ) -> CompletionLogprobs:
        """OpenAI's legacy object; ``top_logprobs`` holds the token and the top k. An entry
        maps ids to floats (sampled tokens) or to ``Logprob`` (prompt tokens, echo); an entry
        None (the first prompt token, which nothing predicts) gives null ``token_logprobs``
        and ``top_logprobs``, as vLLM's. ``text_offset``: where each token's text starts,
        from ``offset`` on (the token texts laid end to end)."""
        def value(lp) -> float:
            return max(lp.logprob if isinstance(lp, Logprob) else lp, MIN_LOGPROB)

        out = CompletionLogprobs()
        for tid, lps in zip(token_ids, logprobs):
            text = self.token_text(tid)
            out.tokens.append(text)
            out.token_logprobs.append(None if lps is None else value(lps[tid]))
            out.top_logprobs.append(None if lps is None else {self.token_text(t): value(lp) for t, lp in lps.items()})
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
        """One chat logprob entry: ``token`` the token decoded alone (U+FFFD for part of a
        character), ``bytes`` the token's own bytes (``Tokenizer.token_bytes``),
        which laid end to end rebuild the text. A model's vocabulary may be padded past its
        tokenizer's (the tiny test models; Qwen2.5's 151,936 rows for 151,665 tokens): an id
        the tokenizer lacks decodes to nothing, as ``tokenizers`` decodes it, so its bytes are
        empty too."""
        text = self.token_text(token_id)
        if self.tokenizer is None:
            raw = text.encode("utf-8")
        elif token_id >= self.tokenizer.vocab_size:
            raw = b""
        else:
            raw = self.tokenizer.token_bytes(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

    # --- running a request ----------------------------------------------------------------
    async def collect(self, stream: RequestStream, request: Request, record: AccessRecord) -> dict:
        """Final output per prompt index (the stream's DELTA outputs merged, O(output) in
        all); aborts the request if the client goes away.

        Raises:
            APIError: 499 when the client disconnected (nobody reads it; it is logged); 500
                (internal error + the request id) when the engine failed on it; 503 when
                the engine loop stopped.
        """
        merged: dict[int, MergedOutput] = {}

        async def consume():
            async for tag, out in stream:
                if record.first_token is None:
                    record.first_token = time.monotonic()
                if tag in merged:
                    merged[tag].add(out)
                else:
                    merged[tag] = MergedOutput(out, stream.delta)

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
        if isinstance(consumer.exception(), EngineDeadError):
            raise APIError(503, str(consumer.exception()), type="server_error", code="engine_dead")
        if isinstance(consumer.exception(), EngineStepError):
            raise internal_error(record.request_id)
        consumer.result()
        return {tag: m.take() for tag, m in merged.items()}

    @staticmethod
    def usage(prompts: list[list[int]], finals: dict) -> UsageInfo:
        """Token counts of final (whole) outputs."""
        return OpenAIServing.usage_of(prompts, sum(len(o.token_ids) for out in finals.values() for o in out.outputs))

    @staticmethod
    def usage_of(prompts: list[list[int]], num_output_tokens: int) -> UsageInfo:
        p = sum(len(x) for x in prompts)
        return UsageInfo(prompt_tokens=p, completion_tokens=num_output_tokens, total_tokens=p + num_output_tokens)

    async def generate(self, req, request: Request, request_id: str, prompts: list[list[int]], params, *,
                       choice, response, chunk, head=(), lora_request: LoRARequest | None = None):
        """Run a request and answer it, streamed or not: what both endpoints share.

        Args:
            req: the request body (``stream``, ``include_usage``).
            request: the HTTP request (its disconnect aborts a non-streamed request).
            request_id: the response's ``id``.
            prompts: token ids per prompt; choice ``i`` of prompt ``tag`` is ``tag * n + i``.
            params: the engine's sampling parameters.
            choice: ``(ChoicePart, streamed) ->`` the endpoint's choice object (streamed: or a
                list of them, sent as one chunk each).
            response: ``(choices, usage) ->`` the non-streamed body.
            chunk: ``(choices, usage) ->`` one streamed chunk (usage None but in the last).
            head: chunks streamed before any delta (built lazily, as they are sent).
            lora_request: the adapter the request's ``model`` named (None: the base model).
        """
        record = access_record(request)
        record.request_id, record.prompt_tokens = request_id, sum(len(p) for p in prompts)
        stream = await self.submit(request_id, prompts, params, cache_salt=req.cache_salt, lora_request=lora_request)
        if req.stream:
            events = self.events(stream, prompts, params.n, record, choice, chunk, head, req.include_usage)
            return EventStreamResponse(events, on_close=stream.close)
        finals = await self.collect(stream, request, record)
        failed = [(tag, c) for tag, out in sorted(finals.items()) for c in out.outputs if c.finish_reason == "error"]
        if failed:  # vLLM answers a non-streamed "error" with an error status too; streamed, the chunk says it
            tag, c = failed[0]
            raise APIError(400, f"choice {tag * params.n + c.index} could not go on after {len(c.token_ids)} tokens: "
                                "the request's allowed_token_ids, bad_words, min_tokens and structured output together "
                                "left no token to generate")
        parts = [ChoicePart(tag, tag * params.n + c.index, c, c.text, c.token_ids, c.logprobs,
                            prompt_logprobs=out.prompt_logprobs)
                 for tag, out in sorted(finals.items()) for c in out.outputs]
        usage = self.usage(prompts, finals)
        record.output_tokens = usage.completion_tokens
        return response([choice(p, False) for p in sorted(parts, key=lambda p: p.index)], usage)

    async def events(self, stream: RequestStream, prompts: list[list[int]], n: int, record: AccessRecord,
                     choice, chunk, head, include_usage: bool):
        """The server-sent events of :meth:`generate`: ``head``, one chunk per choice that
        advanced (its new text, token ids and logprobs), the usage chunk if asked, ``[DONE]``."""
        num_tokens, sent_text, finished = 0, {}, set()
        prompt_logprobs = {}  # tag -> RequestOutput.prompt_logprobs (sent once, for every choice's first part)
        try:
            for event in head:
                yield sse(event)
            async for tag, out in stream:
                if out.prompt_logprobs is not None:
                    prompt_logprobs[tag] = out.prompt_logprobs
                for c in out.outputs:
                    index = tag * n + c.index
                    if index in finished or not (c.delta_token_ids or c.delta_text or c.finish_reason):
                        continue
                    if record.first_token is None:
                        record.first_token = time.monotonic()
                    new = c.delta_token_ids
                    num_tokens += len(new)
                    # (DELTA outputs: token_ids is new and this takes all; CUMULATIVE: the tail)
                    logprobs = None if c.logprobs is None else c.logprobs[len(c.token_ids) - len(new):]
                    part = ChoicePart(tag, index, c, c.delta_text, new, logprobs,
                                      text_offset=sent_text.get(index, 0), first=index not in sent_text,
                                      prompt_logprobs=prompt_logprobs.get(tag))
                    sent_text[index] = part.text_offset + len(c.delta_text)
                    if c.finish_reason is not None:
                        finished.add(index)
                    shaped = choice(part, True)
                    for one in shaped if isinstance(shaped, list) else [shaped]:
                        yield sse(chunk([one], None))
            if include_usage:
                yield sse(chunk([], self.usage_of(prompts, num_tokens)))
        except EngineDeadError as e:
            yield sse(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code="engine_dead")))
        except EngineStepError:  # the traceback is logged by the engine loop
            e = internal_error(record.request_id)
            yield sse(ErrorResponse(error=ErrorInfo(message=e.message, type=e.type, code=e.code)))
        finally:
            stream.close()
            record.output_tokens = num_tokens  # also when cut short
        yield sse("[DONE]")

    # --- /v1/completions ------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, request: Request):
        lora = self.check_request(req)
        model = self.model_name if lora is None else lora.lora_name
        prompt = req.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            prompt = [prompt]  # one prompt ([] is an empty one, which the engine refuses)
        prompts = await self.engine_prompts(prompt, "prompt")
        # echo with max_tokens 0 (OpenAI's way to score a prompt, lm-eval's loglikelihood):
        # the engine runs one token, as vLLM's does, and the answer leaves it out
        echo_only = bool(req.echo) and req.max_tokens == 0
        max_tokens = self.max_tokens(prompts, 1 if echo_only else req.max_tokens, "max_tokens" in req.model_fields_set,
                                     default=16, param="max_tokens")
        # with echo, the prompt's logprobs too, as many top ones (checked as logprobs)
        params = await self.sampling_params(req, max_tokens, req.logprobs,
                                            prompt_logprobs=req.logprobs if req.echo else None)
        echoed = [self.echo_text(p, ids) for p, ids in zip(prompt, prompts)] if req.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"

        def choice(part: ChoicePart, streamed: bool) -> CompletionChoice:
            text, token_ids, logprobs, offset = part.text, list(part.token_ids), part.logprobs, part.text_offset
            finish_reason, stop_reason = part.output.finish_reason, part.output.stop_reason
            ids = token_ids
            if echo_only:  # nothing generated is returned
                text, token_ids, ids, logprobs = "", [], [], []
                finish_reason, stop_reason = ("length", None) if finish_reason is not None else (None, None)
            if req.echo and part.first:  # the prompt first: its text, tokens and logprobs (the first None)
                text = echoed[part.tag] + text
                ids = prompts[part.tag] + ids
                if req.logprobs is not None:
                    logprobs = list(part.prompt_logprobs) + list(logprobs)
            elif req.echo:
                offset += len(echoed[part.tag])
            return CompletionChoice(
                index=part.index, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
                logprobs=self.completion_logprobs(ids, logprobs, offset=offset)
                if req.logprobs is not None else None,
                prompt_token_ids=prompts[part.tag] if req.return_token_ids and part.first else None,
                token_ids=token_ids if req.return_token_ids else None)

        def body(choices, usage) -> CompletionResponse:  # streamed chunks have the same shape
            if echo_only and usage is not None:  # the one token run is not returned: not counted
                usage = self.usage_of(prompts, 0)
            return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

        return await self.generate(req, request, request_id, prompts, params, choice=choice, response=body,
                                   chunk=body, lora_request=lora)

    # --- /v1/chat/completions -------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, request: Request):
        lora = self.check_request(req)
        model = self.model_name if lora is None else lora.lora_name
        self.check_messages(req.messages)
        if req.tools and len(req.tools) > self.limits.max_tools:
            raise APIError(400, f"{len(req.tools)} tools is above the server's limit of {self.limits.max_tools}",
                           param="tools")
        tools = req.tool_calling(native=self.native_tools)
        tool_grammar = await asyncio.to_thread(self.prepare_tools, req, tools)
        messages, template_kwargs = tools.render(req.template_messages())
        chat_ids = await self.chat_prompt(messages, req.add_generation_prompt, **template_kwargs)
        [prompt] = await self.engine_prompts([chat_ids], "messages")
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        max_tokens = self.max_tokens([prompt], requested, requested is not None, default=None, param=param)
        top = req.top_logprobs or 0
        renames = {"logprobs": "top_logprobs"}  # the engine's logprobs is chat's top_logprobs
        forced = {}
        if tool_grammar is not None:  # required or a named function: decoded under the calls' grammar
            forced, renames["structured_outputs"] = {"structured_outputs": tool_grammar}, "tools"
        params = await self.sampling_params(req, max_tokens, top if req.logprobs else None, renames=renames, **forced)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams: dict[int, ToolCallStream] = {}  # per choice, when the output is parsed for calls

        def extras(part: ChoicePart, first: bool = True) -> dict:
            """A choice's logprobs and token ids: those of the part on its first chunk only."""
            ids, lps = (part.token_ids, part.logprobs) if first else ([], [])
            return dict(logprobs=self.chat_logprobs(ids, lps, top) if req.logprobs else None,
                        token_ids=list(ids) if req.return_token_ids else None)

        def finish_reason(part: ChoicePart, calls: list) -> str | None:
            reason = part.output.finish_reason
            return "tool_calls" if calls and reason in ("stop", "length") else reason

        def choice(part: ChoicePart, streamed: bool):
            if not streamed:
                content, calls = (parse_tool_calls(part.text, tools.names, tools.parallel) if tools.active
                                  else (part.text, []))
                message = ResponseMessage(content=content, tool_calls=[
                    ToolCall(id=c.id, function=FunctionCallResponse(name=c.name, arguments=c.arguments))
                    for c in calls] or None)
                return ChatCompletionChoice(index=part.index, message=message, finish_reason=finish_reason(part, calls),
                                            stop_reason=part.output.stop_reason, **extras(part))
            if not tools.active:
                return ChatStreamChoice(index=part.index, delta=DeltaMessage(content=part.text),
                                        finish_reason=part.output.finish_reason, stop_reason=part.output.stop_reason,
                                        **extras(part))
            stream = streams.setdefault(part.index, ToolCallStream(tools.names, tools.parallel))
            content, calls = stream.push(part.text), []
            if part.output.finish_reason is not None:
                rest, calls = stream.finish()
                content += rest
            # OpenAI's shape: per call, one delta with its id, type and name, then its arguments
            deltas = [DeltaMessage(content=content)] if content or not calls else []
            for k, c in enumerate(calls):
                deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=k, id=c.id, type="function", function=DeltaFunctionCall(name=c.name, arguments=""))]))
                deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=k, function=DeltaFunctionCall(arguments=c.arguments))]))
            last = len(deltas) - 1
            return [ChatStreamChoice(index=part.index, delta=d, **extras(part, first=i == 0),
                                     finish_reason=finish_reason(part, calls) if i == last else None,
                                     stop_reason=part.output.stop_reason if i == last else None)
                    for i, d in enumerate(deltas)]

        def response(choices, usage) -> ChatCompletionResponse:
            return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                          prompt_token_ids=prompt if req.return_token_ids else None)

        def chunk(choices, usage, prompt_token_ids=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage,
                                       prompt_token_ids=prompt_token_ids)

        # the first chunk of each choice carries the role, as OpenAI's does
        head = (chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], None,
                      prompt_token_ids=prompt if req.return_token_ids and i == 0 else None) for i in range(params.n))
        return await self.generate(req, request, request_id, [prompt], params, choice=choice, response=response,
                                   chunk=chunk, head=head, lora_request=lora)

    # --- the small endpoints --------------------------------------------------------------
    def models(self) -> ModelList:
        # root: the served name, not the model's path on this machine; an adapter's parent is the base
        # model (vLLM's cards)
        return ModelList(data=[ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.max_model_len),
                               *(ModelCard(id=name, root=name, parent=self.model_name,
                                           max_model_len=self.max_model_len) for name in self.lora_requests)])

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """Size-checked, then tokenized (or the chat rendered) in a worker thread."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            self.check_messages(req.messages, for_tokenize=True)
            ids = await self.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages],
                                         req.add_generation_prompt)
        else:
            tok = self.require_tokenizer("tokenize")
            self.check_text_size(len(req.prompt), "prompt", for_tokenize=True)
            ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """Checked and decoded in a worker thread (the list is bounded by the body only)."""
        self.check_model(req.model)
        tok = self.require_tokenizer("detokenize")
        vocab = self.engine.model_config.vocab_size

        def run() -> str:
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
            return tok.decode(req.tokens)

        return DetokenizeResponse(prompt=await asyncio.to_thread(run))

    def prepare(self) -> None:
        """Build what the first structured-output request would otherwise build while the
        others wait: llguidance's tokenizer (its build holds the GIL). Nothing without
        llguidance or a tokenizer."""
        structured = getattr(getattr(self.engine, "sampler", None), "structured", None)
        if structured is not None:
            try:
                structured.prepare()
            except ValueError as e:  # llguidance missing: structured requests get its 400
                logger.info("structured outputs are unavailable: %s", e)


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


def create_app(engine, *, served_model_name: str, api_key: str | None = None,
               limits: ServerLimits | None = None, log_requests: bool = True, metrics_auth: bool = True,
               lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``LLMEngine`` nothing else may use meanwhile).

    The engine loop starts with the app (its lifespan) and stops with it; run the app with
    uvicorn (``uvicorn.run(app, host=..., port=...)``).

    Args:
        engine: the ``LLMEngine``.
        served_model_name: the name ``/v1/models`` lists and requests' ``model`` must match.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``
            (``/docs`` and ``/openapi.json`` too).
        limits: see :class:`ServerLimits`.
        log_requests: write one access line per request.
        metrics_auth: with ``api_key``, ``/metrics`` needs the key too (False: open, for a
            scraper that cannot send one; its figures are counts and latencies, no text).
        lora_modules: adapter name -> PEFT adapter directory (vLLM's ``--lora-modules``): a
            request whose ``model`` is the name runs that adapter; ``/v1/models`` lists them.
            Each is loaded now (the engine needs ``enable_lora``).

    Raises:
        ValueError: ``api_key`` is the empty string (a key nobody could mean); an adapter
            name that is the served model's, or an adapter that cannot be loaded.
    """
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError(f"api_key={api_key!r} is invalid: give a non-empty key, or None for no authentication")
    limits = limits or ServerLimits()
    if served_model_name in (lora_modules or {}):
        raise ValueError(f"LoRA module name {served_model_name!r} is the served model's name: give it another")
    engine_loop = AsyncEngine(engine, max_waiting_requests=limits.max_waiting_requests)
    serving = OpenAIServing(engine_loop, served_model_name, limits, lora_modules)
    for lora in serving.lora_requests.values():  # a bad adapter fails at start, not at its first request
        engine.add_lora(lora)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(serving.prepare)
        engine_loop.start()
        try:
            yield
        finally:
            await engine_loop.stop()

    app = FastAPI(title="refengine", lifespan=lifespan)  # /docs, /redoc and /openapi.json: FastAPI's
    app.state.engine_loop = engine_loop
    app.state.serving = serving
    # added last = outermost: the access log sees the 401s and 413s too
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           open_paths=frozenset({"/health"} if metrics_auth else {"/health", "/metrics"}))
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
        record = getattr(request.state, "access", None)
        err = internal_error(record.request_id if record is not None and record.request_id != "-" else None)
        if record is not None:
            record.request_id = err.message.rsplit(" ", 1)[-1].rstrip(")")  # the access line names it too
        logger.error("unhandled error on %s: %s", request.url.path, err.message, exc_info=e)
        return error_response(500, err.message, err.type, code=err.code)

    # What /openapi.json documents (runtime ignores it): every error is OpenAI's error body.
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}

    def documented(model, stream_model=None) -> dict:
        ok = {"model": model}
        if stream_model is not None:
            ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
            ok["description"] = f"{model.__name__}, or with stream=true server-sent {stream_model.__name__} events"
        return {**errors, 200: ok}

    @app.get("/health", response_class=Response,  # an empty 200, not JSON: what the schema says too
             responses={200: {"description": "the engine loop runs (empty body)"}, 503: {"model": ErrorResponse}})
    async def health():
        """200 while the engine loop runs; 503 once it has stopped (shut down, or died
        after an error: see ``AsyncEngine.max_consecutive_step_failures``)."""
        if not engine_loop.is_running:
            return error_response(503, "the engine loop is not running", "server_error")
        return Response(status_code=200)

    @app.get("/metrics", responses={401: {"model": ErrorResponse}, 200: {"content": {"text/plain": {}}}})
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=documented(ModelList))
    async def models():
        return serving.models()

    @app.post("/v1/completions", responses=documented(CompletionResponse, CompletionResponse))
    async def completions(req: CompletionRequest, request: Request):
        return await serving.create_completion(req, request)

    @app.post("/v1/chat/completions", responses=documented(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serving.create_chat_completion(req, request)

    @app.post("/tokenize", responses=documented(TokenizeResponse))
    async def tokenize(req: TokenizeRequest):
        return await serving.tokenize(req)

    @app.post("/detokenize", responses=documented(DetokenizeResponse))
    async def detokenize(req: DetokenizeRequest):
        return await serving.detokenize(req)

    return app


def _check_text_list(texts: list[str], param: str, names: tuple[str, str], max_items: int, max_chars: int) -> None:
    """A 400 naming ``param`` when ``texts`` holds more than ``max_items`` strings or one longer
    than ``max_chars`` characters; ``names`` is how the message says the list and one item."""
    if len(texts) > max_items:
        raise APIError(400, f"{len(texts)} {names[0]} is above the server's limit of {max_items}", param=param)
    long = next((x for x in texts if len(x) > max_chars), None)
    if long is not None:
        raise APIError(400, f"a {names[1]} of {len(long)} characters is above the server's limit of {max_chars}",
                       param=param)
