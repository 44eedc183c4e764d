"""Tool calling for chat completions: OpenAI's ``tools``, ``tool_choice`` and ``tool_calls``.

What a request with tools goes through (:class:`ToolCalling` holds one request's tools):

1. **Checks** (:func:`check_tools`): every ``parameters`` is a valid JSON schema (``jsonschema``'s
   meta-schema check) of an object; function names are unique; a named ``tool_choice`` names
   one of them. A bad definition is a :class:`ToolsError` (HTTP 400) naming the field.
2. **The prompt** (:meth:`ToolCalling.render`): a chat template that takes ``tools`` and
   writes Hermes' ``<tool_call>`` format (Qwen2.5, Qwen3, Hermes, SmolLM3: transformers'
   ``apply_chat_template(tools=...)`` convention) gets them as its ``tools`` variable, and
   the history's ``tool_calls`` and ``role: "tool"`` messages as they are. Any other template
   gets the *generic* format (llama.cpp's idea, for templates that know no tools): the tools
   are described in the system message with the format to call them in, past calls become
   the assistant's text in that format and tool results a user turn in
   ``<tool_response>`` tags. Either way a call is written::

       <tool_call>
       {"name": "get_weather", "arguments": {"city": "Paris"}}
       </tool_call>

3. **Decoding**: with ``tool_choice: "required"`` or a named function the output is
   constrained by llguidance (:func:`tool_call_grammar`) to one or more such calls (one when
   ``parallel_tool_calls`` is false) whose object is ``{"name": <const>, "arguments":
   <the function's parameters schema>}``, so the arguments validate against the schema (as
   vLLM forces ``required`` and named choices with guided decoding; it writes a bare JSON
   array or object, refengine keeps the tags, so that the constrained output is the format the
   prompt shows and the same parser reads it). With ``"auto"`` decoding is unconstrained and
   the model may answer or call; its text is parsed afterwards (vLLM's way: the ``hermes``
   tool parser). With ``"none"`` the tools are left out of the prompt and nothing is parsed
   (vLLM's ``--exclude-tools-when-tool-choice-none``).
4. **Parsing** (:func:`parse_tool_calls`, :class:`ToolCallStream` for streams): the text before
   the first ``<tool_call>`` is the message's content; each call's JSON becomes a ``tool_call``
   with an id ``call_<24 hex digits>``, the function's name and its arguments as a JSON
   string. A call that is not JSON, names no given function or has no object arguments
   (only possible with ``auto``, or when ``max_tokens`` cuts a forced call) turns the whole
   output back into plain content, as vLLM's hermes parser does. A stream sends content as
   it comes, holds back what could be the start of ``<tool_call>``, and sends the calls when
   the choice finishes, so streamed and non-streamed answers are the same.

Sources: OpenAI's chat completions API (tools, tool_choice, parallel_tool_calls, the
``delta.tool_calls`` chunks); vLLM's ``entrypoints/openai/tool_parsers/hermes_tool_parser.py``
and its ``required``/named tool_choice guided decoding (``protocol.py``,
``_get_json_schema_from_tool``); llama.cpp's generic format (``common/chat.cpp``) and minja's
tool polyfills for templates without tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.S)

#: The system prompt of the generic format; ``{tools}`` is the function definitions, one JSON per
#: line. The instructions come first, so that requests with different tools share their prefix
#: (prefix caching).
GENERIC_TOOLS_PROMPT = (
    "You can call functions. To call one, answer with its name and arguments as JSON in "
    "<tool_call></tool_call> tags, one call per tag:\n"
    "<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments object>}}\n'
    "</tool_call>\n"
    "Otherwise answer directly. The functions:\n"
    "<tools>\n{tools}\n</tools>"
)


class ToolsError(ValueError):
    """A bad ``tools`` or ``tool_choice`` (HTTP 400); ``param`` is the request field to name."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class FunctionCall:
    """One parsed call: the function's ``name`` and its ``arguments`` as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def check_tools(functions: list[dict]) -> None:
    """Refuse tool definitions that cannot be called or constrained.

    Args:
        functions: each tool's ``function`` object (``name``, ``description``, ``parameters``),
            already shaped by the request model (``type`` is ``"function"``, ``name`` matches
            OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``).

    Raises:
        ToolsError: a name given twice, or ``parameters`` that is not a JSON schema (the
            message is ``jsonschema``'s, with the function's index) or not one of an object
            (OpenAI's rule: arguments are a JSON object).
    """
    import jsonschema

    seen = set()
    for i, f in enumerate(functions):
        name = f["name"]
        if name in seen:
            raise ToolsError("tools", f"tools[{i}].function.name {name!r} is given twice: names must be unique")
        seen.add(name)
        schema = f.get("parameters")
        if schema is None:
            continue
        if not isinstance(schema.get("$schema", ""), str):
            raise ToolsError("tools", f"tools[{i}].function.parameters.$schema must be a string (a meta-schema's URI)")
        try:
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path)
            raise ToolsError("tools", f"tools[{i}].function.parameters is not a valid JSON schema "
                                      f"(at {where!r}): {e.message}") from None
        if schema.get("type", "object") != "object":
            raise ToolsError("tools", f"tools[{i}].function.parameters must be the schema of an object "
                                      f"(type 'object'), got type {schema.get('type')!r}")


def arguments_schema(function: dict) -> dict:
    """The JSON schema a call's ``arguments`` must match: ``parameters`` (an object schema;
    ``type: "object"`` added where it is left out), or any object for a function without them."""
    schema = function.get("parameters")
    if schema is None:
        return {"type": "object"}
    return schema if "type" in schema else {**schema, "type": "object"}


def tool_call_grammar(functions: list[dict], parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect, with its ``%json`` schemas) of one or more calls
    of ``functions`` (one when not ``parallel``), each ``<tool_call>\\n{json}\\n</tool_call>``
    with the JSON ``{"name": <one of the names>, "arguments": <that function's schema>}`` on
    one line.

    The functions' ``$defs`` move to the top of the call's schema, where their ``#/$defs/...``
    references resolve (vLLM does the same for ``required``).

    Raises:
        ToolsError: two functions define the same ``$defs`` name differently.
    """
    defs: dict = {}
    calls = []
    for f in functions:
        args = dict(arguments_schema(f))
        for key in ("$defs", "definitions"):
            if not isinstance(args.get(key, {}), dict):
                raise ToolsError("tools", f"function {f['name']!r}: {key} must be an object of schemas")
            for name, d in args.pop(key, {}).items():
                if defs.setdefault(key, {}).setdefault(name, d) != d:
                    raise ToolsError("tools", f"function {f['name']!r} defines {key}/{name} differently from "
                                              "another function: give the shared definitions one meaning")
        calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # one line of JSON, as the prompt shows a call: at most a space between tokens (an
    # indented object costs tokens, and a small model can indent on to max_tokens)
    schema = {**schema, **defs, "x-guidance": {"whitespace_pattern": " ?"}}
    call = f'"{TOOL_CALL_START}\\n" %json {json.dumps(schema)} "\\n{TOOL_CALL_END}"'
    # calls follow each other directly: after a call the model picks another "<tool_call>" or
    # the end (with a newline between, SmolLM2-135M wrote the same call again and again)
    more = " call*" if parallel else ""
    return f"start: call{more}\ncall: {call}\n"


def parse_tool_calls(text: str, names: set[str], parallel: bool = True) -> tuple[str | None, list[FunctionCall]]:
    """``(content, calls)`` of a model's output: the text before the first ``<tool_call>``
    (right-stripped; None if nothing is left) and the calls after it, or ``(text, [])`` when
    there is no call or any call is not ``{"name": <one of names>, "arguments": {...}}`` JSON
    (a last call without its closing tag is read to the end of the text, as vLLM's hermes
    parser does). ``parallel`` False keeps the first call only."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL_BLOCK.finditer(text, start):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        args = call.get("arguments") if isinstance(call, dict) else None
        if not isinstance(args, dict) or call.get("name") not in names:
            return text, []
        calls.append(FunctionCall(call["name"], json.dumps(args, ensure_ascii=False)))
    return text[:start].rstrip() or None, calls if parallel else calls[:1]


class ToolCallStream:
    """One streamed choice's content and calls: :meth:`push` each new piece of text and send
    what it returns as content; :meth:`finish` gives the rest and the calls, which are
    :func:`parse_tool_calls` of the whole text (so a stream agrees with a whole answer).

    Held back until more text comes: trailing whitespace (content before a call is
    right-stripped) and a tail that could be the start of ``<tool_call>``; everything from
    ``<tool_call>`` on."""

    def __init__(self, names: set[str], parallel: bool):
        self.names, self.parallel = names, parallel
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.in_call = False

    def push(self, delta: str) -> str:
        """The content to send for ``delta`` (may be empty)."""
        self.text += delta
        if self.in_call:
            return ""
        start = self.text.find(TOOL_CALL_START, max(0, self.sent - len(TOOL_CALL_START)))
        if start >= 0:
            self.in_call = True
            safe = len(self.text[:start].rstrip())
        else:
            safe = len(self.text)
            for k in range(min(len(TOOL_CALL_START) - 1, len(self.text)), 0, -1):
                if TOOL_CALL_START.startswith(self.text[-k:]):
                    safe -= k
                    break
            safe = len(self.text[:safe].rstrip())
        out = self.text[self.sent:max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return out

    def finish(self) -> tuple[str, list[FunctionCall]]:
        """``(content not yet sent, calls)`` once the choice has finished."""
        content, calls = parse_tool_calls(self.text, self.names, self.parallel)
        rest = (content or "")[self.sent:]
        self.sent += len(rest)
        return rest, calls


@dataclass
class ToolCalling:
    """One chat request's tools: what it renders into the prompt, the grammar it forces, how its
    output is parsed.

    Attributes:
        functions: the tools' ``function`` objects (``name``, ``description``, ``parameters``).
        tool_choice: ``"none"``, ``"auto"``, ``"required"``, or the name of the function to call.
        parallel: ``parallel_tool_calls`` (OpenAI's default True): more than one call per answer.
        native: the chat template takes ``tools`` and writes ``<tool_call>`` (else: the generic format).
    """

    functions: list[dict]
    tool_choice: str
    parallel: bool = True
    native: bool = False

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    @property
    def active(self) -> bool:
        """The tools are in the prompt and the output is parsed (any choice but ``"none"``)."""
        return bool(self.functions) and self.tool_choice != "none"

    @property
    def forced(self) -> list[dict] | None:
        """The functions the output must call (``"required"``: all, a name: that one), else None."""
        if not self.active or self.tool_choice == "auto":
            return None
        if self.tool_choice == "required":
            return self.functions
        return [f for f in self.functions if f["name"] == self.tool_choice]

    def grammar(self) -> str | None:
        """:func:`tool_call_grammar` of :attr:`forced`, or None when the output is free."""
        forced = self.forced
        return None if forced is None else tool_call_grammar(forced, self.parallel)

    def render(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """``(messages, template variables)`` for the chat template, from OpenAI-shaped
        messages (``tool_calls`` with JSON-string arguments, ``role: "tool"`` with
        ``tool_call_id``): see the module's docstring."""
        tools = [{"type": "function", "function": f} for f in self.functions] if self.active else None
        if self.native:
            return [_native_message(m) for m in messages], ({"tools": tools} if tools else {})
        out = _generic_messages(messages)
        if tools:
            prompt = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(f, ensure_ascii=False)
                                                                  for f in self.functions))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, {}


def template_writes_tool_calls(template: str | None, variables: frozenset[str]) -> bool:
    """Whether a chat template takes transformers' ``tools`` variable and writes Hermes'
    ``<tool_call>`` format (``variables``: the template's undeclared variables)."""
    return template is not None and "tools" in variables and TOOL_CALL_START in template


def _arguments_object(arguments: str):
    """A past call's arguments as the object templates expect (transformers' convention);
    the string itself if it is not a JSON object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _native_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{"id": c.get("id"), "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _generic_messages(messages: list[dict]) -> list[dict]:
    """Messages any template renders: an assistant's ``tool_calls`` appended to its text in
    the ``<tool_call>`` format, each run of ``role: "tool"`` messages one user turn of
    ``<tool_response>`` blocks (Hermes' way)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
            continue
        if m.get("tool_calls"):
            blocks = [f"{TOOL_CALL_START}\n"
                      + json.dumps({"name": c["function"]["name"],
                                    "arguments": _arguments_object(c["function"]["arguments"])}, ensure_ascii=False)
                      + f"\n{TOOL_CALL_END}" for c in m["tool_calls"]]
            # joined as the grammar writes calls: one after the other
            content = (f"{m['content']}\n" if m.get("content") else "") + "".join(blocks)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
        out.append(dict(m))
    for m in out:
        m.pop("_tool_responses", None)
    return out
