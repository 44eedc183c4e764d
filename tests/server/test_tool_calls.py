"""Tool calling's parts without a model (refengine/server/tool_calls.py): the parser and its
streaming twin, the prompt in both formats, the calls' grammar under llguidance, the tool
checks. The served model's calls are in tests/server/test_server.py."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

import tokenizers  # noqa: E402

from refengine.server.tool_calls import (ToolCalling, ToolCallStream, ToolsError, check_tools,  # noqa: E402
                                         parse_tool_calls, template_writes_tool_calls)
from refengine.structured_output import StructuredOutputManager, StructuredOutputsParams  # noqa: E402
from refengine.tokenizer import Tokenizer  # noqa: E402

NAMES = {"get_weather", "add"}
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ("Just an answer.", "Just an answer.", []),
    (CALL_A, None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n\n" + CALL_A + "\n" + CALL_B, "Let me look.",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    (CALL_A + CALL_B[:-len("</tool_call>")], None,  # a last call without its closing tag is read to the end
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    # anything that is not a call of a given function: the whole text is content (vLLM's hermes parser)
    ("a <tool_call>{not json}</tool_call>", "a <tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     []),
    ('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>',
     '<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', []),
    (CALL_A + CALL_B[:30], CALL_A + CALL_B[:30], []),  # cut by max_tokens
])
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_parse_keeps_one_call_without_parallel_tool_calls():
    assert calls_of(parse_tool_calls(CALL_A + CALL_B, NAMES, parallel=False)[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    "Just an answer.", "  leading and trailing  \n", "a < b <tool and <tool_cal but no call", CALL_A,
    "Let me look.  \n" + CALL_A + "\n" + CALL_B, "x <tool_call>{broken", "", "<tool_call", "<<tool_call>\n" + CALL_B,
])
@pytest.mark.parametrize("seed", range(4))
def test_stream_agrees_with_the_whole_text(text, seed):
    """Any split into pieces: the content sent, then finish's rest and calls, equal what
    parse_tool_calls makes of the whole text; no piece of a call is ever sent as content."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    stream = ToolCallStream(NAMES, parallel=True)
    sent = [stream.push(p) for p in pieces]
    rest, calls = stream.finish()
    content, want = parse_tool_calls(text, NAMES)
    assert "".join(sent) + rest == (content or "")
    assert calls_of(calls) == calls_of(want)
    if want:
        assert "<" not in "".join(sent).replace("a < b", "")


def test_stream_holds_back_only_what_could_start_a_call():
    stream = ToolCallStream(NAMES, parallel=True)
    assert stream.push("Hello <tool") == "Hello"  # the space too: content before a call is stripped
    assert stream.push("box> there") == " <toolbox> there"
    assert stream.push("\n\n" + CALL_A) == ""
    assert stream.finish()[0] == ""


# --- the prompt -----------------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the shape of Qwen2.5's template (tools in the system turn, calls and results in tags), shortened
HERMES = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]


def tokenizer_with(template: str) -> Tokenizer:
    vocab = {"<unk>": 0}
    return Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
                     {"chat_template": template})


def render(template: str, tools: ToolCalling, messages=HISTORY) -> str:
    tok = tokenizer_with(template)
    tools.native = template_writes_tool_calls(tok.chat_template, tok.chat_template_variables)
    msgs, kwargs = tools.render(messages)
    return tok.apply_chat_template(msgs, **kwargs)


def test_generic_format_for_a_template_without_tools():
    assert not template_writes_tool_calls(CHATML, tokenizer_with(CHATML).chat_template_variables)
    text = render(CHATML, ToolCalling([WEATHER], "auto"))
    system, user, assistant, results, head = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nYou can call functions.")
    assert system.endswith(f"<tools>\n{json.dumps(WEATHER)}\n</tools>")
    assert '{"name": <function name>, "arguments": <arguments object>}' in system
    assert user == "<|im_start|>user\nWeather in Paris and Rome?"
    assert assistant == ('<|im_start|>assistant\n'
                         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert results == ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
                       "<tool_response>\n25 C\n</tool_response>")
    assert head == "<|im_start|>assistant\n"
    # a system message of the request keeps its text, the tools follow it; "none" leaves them out
    with_system = render(CHATML, ToolCalling([WEATHER], "auto"), [{"role": "system", "content": "Be brief."}] + HISTORY)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert "You can call" not in render(CHATML, ToolCalling([WEATHER], "none"))
    assert "<tool_response>\n18 C" in render(CHATML, ToolCalling([], "auto"))  # history without tools


def test_native_format_for_a_template_that_takes_tools():
    assert template_writes_tool_calls(HERMES, tokenizer_with(HERMES).chat_template_variables)
    text = render(HERMES, ToolCalling([WEATHER], "required"))
    assert text.startswith('<|im_start|>system\n# Tools\n<tools>{"type": "function", "function": '
                           + json.dumps(WEATHER))
    assert "You can call" not in text  # the template's own words, not the generic ones
    # arguments reach the template as objects (transformers' convention), so tojson writes them once
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<tool_response>\n25 C\n</tool_response>" in text


# --- the grammar ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def char_manager():
    """llguidance over a character-level tokenizer (a token per printable ASCII character)."""
    symbols = ["<unk>", "</s>", *map(chr, range(32, 127)), "\n"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("(?m)."), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.add_special_tokens(symbols[:2])
    wrapped = Tokenizer(tok, {"eos_token": "</s>"})
    return StructuredOutputManager(wrapped, len(symbols), [1]), wrapped


ADD = {"name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                                     "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "b": {"$ref": "#/$defs/digit"}},
                                     "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}}}}


def accepts(manager, grammar: str, text: str) -> bool:
    mgr, tok = manager
    matcher = mgr.new_matcher(StructuredOutputsParams(grammar=grammar))
    ids = tok.encode(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("choice, parallel, text, ok", [
    ("required", True, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', True),
    ("required", True, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>', True),
    ("required", True, CALL_A + CALL_B, True),
    ("required", False, CALL_A + CALL_B, False),  # parallel_tool_calls: false
    ("required", True, "Sure!", False),  # an answer is no call
    ("required", True, '<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 2}}\n</tool_call>', False),
    ("required", True, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', False),
    ("required", True, '<tool_call>\n{"name": "mul", "arguments": {"a": 1, "b": 2}}\n</tool_call>', False),
    ("required", True, '<tool_call>\n{"name": "add",\n"arguments": {"a": 1, "b": 2}}\n</tool_call>', False),
    ("add", True, CALL_B, True),
    ("add", True, CALL_A, False),  # a named choice: that function only
])
def test_forced_calls_grammar(char_manager, choice, parallel, text, ok):
    weather = {**WEATHER, "parameters": {**WEATHER["parameters"], "additionalProperties": False}}
    grammar = ToolCalling([weather, ADD], choice, parallel=parallel).grammar()
    assert accepts(char_manager, grammar, text) is ok
    assert ToolCalling([weather, ADD], "auto").grammar() is None  # auto decodes freely


@pytest.mark.parametrize("functions, fragments", [
    ([WEATHER, WEATHER], ["tools[1].function.name 'get_weather' is given twice"]),
    ([{"name": "f", "parameters": {"type": "objekt"}}], ["tools[0].function.parameters", "(at 'type')", "'objekt'"]),
    ([WEATHER, {"name": "f", "parameters": {"type": "object", "properties": {"x": {"minimum": "0"}}}}],
     ["tools[1].function.parameters", "(at 'properties/x/minimum')", "'0' is not of type 'number'"]),
    ([{"name": "f", "parameters": {"type": "string"}}], ["tools[0].function.parameters must be the schema of an object",
                                                         "'string'"]),
])
def test_bad_tools_are_named(functions, fragments):
    with pytest.raises(ToolsError) as e:
        check_tools(functions)
    assert e.value.param == "tools"
    for fragment in fragments:
        assert fragment in str(e.value)


def test_conflicting_defs_are_refused():
    other = {"name": "g", "parameters": {"type": "object", "$defs": {"digit": {"type": "string"}}}}
    check_tools([ADD, other])
    with pytest.raises(ToolsError, match="defines \\$defs/digit differently"):
        ToolCalling([ADD, other], "required").grammar()
