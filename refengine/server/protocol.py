"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names are OpenAI's (``/v1/completions``, ``/v1/chat/completions``) plus vLLM's
extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids`` (duplicates dropped), ``include_stop_str_in_output``, ``skip_special_tokens``,
``return_token_ids``, ``cache_salt``, ``allowed_token_ids``, ``bad_words``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``structured_outputs``;
``stop_reason`` on choices); OpenAI's ``echo`` (the prompt's text, and with ``logprobs`` its
tokens' log-probabilities, before the completion's), ``logit_bias`` and ``response_format`` (``text``,
``json_object``, ``json_schema``) on both endpoints. Every list field has a bound
(``refengine.server.api.ServerLimits``; ``logit_bias``: 300 entries, OpenAI's;
``allowed_token_ids``: the vocabulary's size). ``null`` for an optional sampling
field means its default. The sampling fields are generated from ``SamplingParams``'
declaration (each field's ``ApiField``: :func:`sampling_fields`). Unknown request fields are
ignored, as OpenAI's clients send fields a server may not know; OpenAI fields whose meaning refengine does not implement
(``suffix``, ``best_of`` > 1), and fields that OpenAI and vLLM refuse without
another (``stream_options`` without ``stream: true``, ``tool_choice`` without ``tools``), are
refused with 400 by :meth:`unsupported`. Chat takes OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (:mod:`refengine.server.tool_calls`); its messages carry ``tool_calls``
(assistant) and ``tool_call_id`` (``role: "tool"``), and its answers ``tool_calls``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, create_model

from refengine.sampling_params import SamplingParams


def _absent(value) -> bool:
    return value is None


def omitted_if_none():
    """A response field left out of the JSON while None (vLLM's optional extras)."""
    return Field(default=None, exclude_if=_absent)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


def sampling_fields(params_class: type = SamplingParams) -> dict[str, tuple[str, None]]:
    """The request fields of every sampling parameter that declares one
    (:class:`refengine.sampling_params.ApiField`), as pydantic's ``create_model`` takes
    them: ``{name: (ApiField.type + " | None", default None)}``."""
    return {f.name: (f"{f.metadata['api'].type} | None", None) for f in dataclasses.fields(params_class)
            if f.metadata.get("api")}


#: The sampling fields of both endpoints, from ``SamplingParams``' declaration.
_SamplingFields = create_model("_SamplingFields", __base__=_Request, __module__=__name__, **sampling_fields())
#: Sampling fields each endpoint reads itself and passes to :meth:`_SamplingRequest.sampling_params`:
#: ``max_tokens`` is checked against the context, chat's ``logprobs`` is a bool beside ``top_logprobs``.
PER_ENDPOINT_FIELDS = ("max_tokens", "logprobs")


class _SamplingRequest(_SamplingFields):
    """Fields shared by completions and chat completions: the sampling fields and these."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    return_token_ids: bool | None = None
    # vLLM's: with prefix caching, only requests with the same salt share KV blocks
    cache_salt: StrictStr | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* (and structured_outputs)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for a field refengine refuses (400): set to something refengine
        does not implement, or set where OpenAI and vLLM refuse it (``stream_options``
        without ``stream: true``)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None

    def structured_outputs_fields(self) -> list[str]:
        """The request fields that ask for a structured output (``response_format`` of
        type ``text`` does not)."""
        rf = self.response_format
        return [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice",
                                  "guided_grammar", "structured_outputs")
                if getattr(self, name) is not None and not (name == "response_format" and isinstance(rf, dict)
                                                             and rf.get("type", "text") == "text")]

    def structured_outputs_params(self):
        """The ``StructuredOutputsParams`` this request asks for, or None.

        ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
        ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the
        schema is enforced whatever ``strict`` says). vLLM's ``guided_json``,
        ``guided_regex``, ``guided_choice``, ``guided_grammar``, and ``structured_outputs``
        (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``).

        Raises:
            ValueError: more than one of these fields, a malformed ``response_format``, or
                a schema / regex / grammar llguidance refuses (its message).
        """
        from refengine.structured_output import StructuredOutputsParams

        rf = self.response_format
        used = self.structured_outputs_fields()
        if not used:
            return None
        if len(used) > 1:
            raise ValueError(f"give at most one of {', '.join(used)}: each asks for a structured output")
        if used[0] == "response_format":
            kind = rf.get("type")
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind != "json_schema":
                raise ValueError(f"response_format type {kind!r} is not supported: "
                                 "use 'text', 'json_object' or 'json_schema'")
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format of type 'json_schema' needs 'json_schema': "
                                 "{'name': ..., 'schema': {...}} with the schema an object")
            return StructuredOutputsParams(json=spec["schema"])
        if used[0] == "structured_outputs":
            so = self.structured_outputs
            known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                     "whitespace_pattern"}
            extra = sorted(set(so) - known)
            if extra:
                raise ValueError(f"structured_outputs has unknown keys {extra}: known are {sorted(known)}")
            return StructuredOutputsParams(**so)
        name = used[0].removeprefix("guided_")
        return StructuredOutputsParams(**{name: getattr(self, used[0])})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **overrides) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request (unset fields: vLLM's defaults;
        ``overrides``: fields the server sets, e.g. ``output_kind``). A structured output is
        compiled here: the server calls this off its event loop.

        Raises:
            ValueError: a value out of range (``SamplingParams``' message names the field).
        """
        given = {f.name: f.metadata["api"].read(getattr(self, f.name)) for f in dataclasses.fields(SamplingParams)
                 if f.metadata.get("api") and f.name not in PER_ENDPOINT_FIELDS}
        given["structured_outputs"] = self.structured_outputs_params()  # or response_format, guided_*
        kwargs = {k: v for k, v in {**given, **overrides}.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists; each prompt gets ``n`` choices, numbered
    ``prompt_index * n + i``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16  # OpenAI's default here
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "best_of other than n is not supported"
        return super().unsupported()


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Request):
    """A tool's function: OpenAI's name rule; ``parameters`` a JSON schema of an object (checked
    by :func:`refengine.server.tool_calls.check_tools`); ``strict`` is accepted, and the schema
    is enforced where the call is forced whatever it says."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Request):
    """One entry of ``tools``: OpenAI's only kind, a function."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class ChatCompletionNamedToolChoiceParam(_Request):
    """``tool_choice`` naming the function to call: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


class FunctionCallParam(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends and answers it


class ToolCallParam(_Request):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a role "tool" message: the call it answers

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def num_chars(self) -> int:
        """Characters of its text, name and calls (what the size check counts)."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.text()) + len(self.name or "") + calls


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # OpenAI's chat shape: the number is top_logprobs
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True

    def unsupported(self) -> tuple[str, str] | None:
        # OpenAI's and vLLM's rule (any value, "none" included): a choice among no tools is a mistake
        if self.tool_choice is not None and not self.tools:
            return "tool_choice", "tool_choice is only allowed when tools are given"
        choice = self.tool_choice_name
        if choice not in (None, "none", "auto", "required") and choice not in {t.function.name for t in self.tools}:
            return "tool_choice", f"tool_choice names the function {choice!r}, which is not among the tools"
        if self.tool_calling().forced is not None:
            used = self.structured_outputs_fields()
            if used:  # both would constrain the whole output
                return used[0], (f"{used[0]} cannot be combined with tool_choice {choice!r}, which constrains "
                                 "the output to tool calls")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return super().unsupported()

    @property
    def tool_choice_name(self) -> str | None:
        """``tool_choice`` as a string: ``none``, ``auto``, ``required``, or the named function."""
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            return self.tool_choice.function.name
        return self.tool_choice

    def tool_calling(self, native: bool = False):
        """The request's :class:`refengine.server.tool_calls.ToolCalling` (with no functions
        without tools: it still renders the history's calls); ``tool_choice`` defaults to
        ``auto``, OpenAI's default when tools are given. ``native``: the chat template takes
        ``tools`` (:func:`~refengine.server.tool_calls.template_writes_tool_calls`)."""
        from refengine.server.tool_calls import ToolCalling

        functions = [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or ()]
        return ToolCalling(functions, self.tool_choice_name or "auto", parallel=self.parallel_tool_calls is not False,
                           native=native)

    def template_messages(self) -> list[dict]:
        """Messages as the chat template takes them (``role``, ``content`` as a string;
        ``name``, ``tool_calls`` and ``tool_call_id`` in OpenAI's shape where given)."""
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# --------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------


def now_s() -> int:
    """``created`` timestamps: Unix seconds."""
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs object: one entry per token (with ``echo``, the prompt's
    first: its first token's ``token_logprobs`` and ``top_logprobs`` are null)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = omitted_if_none()
    token_ids: list[int] | None = omitted_if_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = omitted_if_none()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCallResponse(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallResponse


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None  # null when the answer is only tool calls (OpenAI's)
    tool_calls: list[ToolCall] | None = omitted_if_none()


class ChatCompletionChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = omitted_if_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = omitted_if_none()
    prompt_token_ids: list[int] | None = omitted_if_none()


class DeltaFunctionCall(BaseModel):
    name: str | None = omitted_if_none()
    arguments: str | None = omitted_if_none()


class DeltaToolCall(BaseModel):
    """A streamed call's part (OpenAI's shape): its first carries ``id``, ``type`` and the
    function's ``name``, the next ones pieces of ``arguments``; ``index`` is the call's."""

    index: int
    id: str | None = omitted_if_none()
    type: Literal["function"] | None = omitted_if_none()
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = omitted_if_none()
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = omitted_if_none()


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = omitted_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = omitted_if_none()
    prompt_token_ids: list[int] | None = omitted_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "refengine"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
