"""The pythonic (Llama 3.2 / 4) and Qwen3-Coder tool-call formats: whole outputs parse to the
expected content and calls, malformed ones stay content as written, Qwen3-Coder's values are typed
by the tool's schema, the same outputs fed in any fragments (hypothesis picks the cuts) give
exactly the unary result, text is held only while it may still be a call, earlier calls written
for a prompt read back as the same calls, and the formats are detected from chat templates."""

from __future__ import annotations

import json
import keyword
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tool_call_syntax import python_literal, pythonic_text, qwen_text
from services.gateway.tool_calls import (
    Tool,
    ToolCall,
    ToolCallParser,
    call_text,
    calls_text,
    detect_format,
    forced_call,
    parse,
    preamble,
    tool_result_text,
)

WEATHER = Tool(
    "get_weather",
    "",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "hot": {"type": "boolean"},
                "ratio": {"type": "number"},
                "opts": {"type": "object"},
                "tags": {"type": "array"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "limit": {"type": ["integer", "null"]},
            },
        }
    ),
)
TOOLS = (WEATHER,)
Calls = list[tuple[str, dict[str, Any]]]


def _qwen(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (format, output, expected content, expected (name, arguments) calls)
CASES: list[tuple[str, str, str | None, Calls]] = [
    (
        "pythonic",
        '[get_weather(city="San Francisco", unit="celsius"), get_time(tz="UTC")]',
        None,
        [("get_weather", {"city": "San Francisco", "unit": "celsius"}), ("get_time", {"tz": "UTC"})],
    ),
    (
        "pythonic",
        " \n<|python_start|>[f(a=-1, b=[1, 2.5, (3, 4)], c={'k': None, 't': True}, d='x\"y',"
        ' e="""tri]p\'le""", g=False)]<|python_end|>',
        None,
        [
            (
                "f",
                {
                    "a": -1,
                    "b": [1, 2.5, [3, 4]],
                    "c": {"k": None, "t": True},
                    "d": 'x"y',
                    "e": "tri]p'le",
                    "g": False,
                },
            )
        ],
    ),
    ("pythonic", "[ping()]", None, [("ping", {})]),
    (
        "pythonic",
        '[f(s="a # not a comment ]")  # a comment ]\n]',
        None,
        [("f", {"s": "a # not a comment ]"})],
    ),
    ("pythonic", "[f(a=1)]\n\nDone.", "\n\nDone.", [("f", {"a": 1})]),
    ("pythonic", "[f(a=1)]\n", None, [("f", {"a": 1})]),
    # malformed, or not a call list: content as written
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "Sure: [f(a=1)]", "Sure: [f(a=1)]", []),
    ("pythonic", "[see(chapter 3)] for details", "[see(chapter 3)] for details", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),  # positional: its name is unknown
    ("pythonic", "[f(a=x)]", "[f(a=x)]", []),  # a variable, not a literal
    ("pythonic", "[f(a=__import__('os'))]", "[f(a=__import__('os'))]", []),
    ("pythonic", "[f(a=1, a=2)]", "[f(a=1, a=2)]", []),
    ("pythonic", "[f(a=1e999)]", "[f(a=1e999)]", []),
    ("pythonic", "[f(a={1: 2})]", "[f(a={1: 2})]", []),
    ("pythonic", "[f(a=b'x')]", "[f(a=b'x')]", []),
    ("pythonic", "[f(**kw)]", "[f(**kw)]", []),
    ("pythonic", "[os.system(a=1)]", "[os.system(a=1)]", []),
    ("pythonic", "[f(a=1), 2]", "[f(a=1), 2]", []),
    ("pythonic", "[f(a=1)", "[f(a=1)", []),  # cut short: never closed
    ("pythonic", '[f(a="""x"', '[f(a="""x"', []),
    ("pythonic", "[f(a=1)][0]", "[0]", [("f", {"a": 1})]),
    ("pythonic", "<|python_start|>hello", "<|python_start|>hello", []),
    ("pythonic", "  ", "  ", []),
    ("pythonic", "", "", []),
    (
        "qwen3_coder",
        "Let me check.\n"
        + _qwen("get_weather", ("city", "Paris"), ("days", "3"), ("hot", "True"))
        + "\n"
        + _qwen("get_time", ("tz", "UTC")),
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3, "hot": True}), ("get_time", {"tz": "UTC"})],
    ),
    (
        "qwen3_coder",
        _qwen("get_weather", ("city", "a\nmulti-line\n\nvalue </parameter> <x>"), ("note", "null")),
        None,
        [("get_weather", {"city": "a\nmulti-line\n\nvalue </parameter> <x>", "note": None})],
    ),
    (
        "qwen3_coder",
        "<tool_call><function=get_weather><parameter=days>4</parameter></function></tool_call> after",
        " after",
        [("get_weather", {"days": 4})],
    ),
    ("qwen3_coder", "<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", {})]),
    # the function closed but </tool_call> cut (max_tokens), or other text after </function>
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_",
        None,
        [("f", {"x": "1"})],
    ),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function> and", " and", [("f", {})]),
    # malformed: content as written, the search going on after the <tool_call>
    (
        "qwen3_coder",
        'a <tool_call>{"name": "f"}</tool_call> b',
        'a <tool_call>{"name": "f"}</tool_call> b',
        [],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n",
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n",
        [],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=bad name!>\n</function>",
        "<tool_call>\n<function=bad name!>\n</function>",
        [],
    ),
    ("qwen3_coder", "<tool_call>\n<function=f\n>", "<tool_call>\n<function=f\n>", []),
    (
        "qwen3_coder",
        "x <tool_call> y " + _qwen("f", ("a", "1")),
        "x <tool_call> y",
        [("f", {"a": "1"})],
    ),
    ("qwen3_coder", "no calls, just < and <tool_ca", "no calls, just < and <tool_ca", []),
]


def _summary(content: str | None, calls: list[ToolCall]) -> tuple[str | None, Calls]:
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(
    fmt: str, pieces: list[str], tools: tuple[Tool, ...] = TOOLS
) -> tuple[str | None, list[ToolCall]]:
    parser = ToolCallParser(fmt, tools=tools)  # type: ignore[arg-type]
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    assert all(isinstance(e, (str, ToolCall)) for e in events)  # whole calls only
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    assert parser.num_calls == len(calls)
    return (content or None) if calls else content, calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_output(fmt: str, text: str, content: str | None, calls: Calls) -> None:
    got_content, got_calls = parse(text, fmt, tools=TOOLS)  # type: ignore[arg-type]
    assert _summary(got_content, got_calls) == (content, calls)
    assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_one_character_at_a_time_gives_the_whole_output_result(
    fmt: str, text: str, content: str | None, calls: Calls
) -> None:
    assert _summary(*_streamed(fmt, list(text))) == (content, calls)


def _cut(text: str, at: list[int]) -> list[str]:
    at = sorted(set(a for a in at if 0 < a < len(text)))
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_any_fragmentation_gives_the_unary_result(
    case: tuple[str, str, str | None, Calls], cuts: list[int]
) -> None:
    fmt, text, _, _ = case
    unary = parse(text, fmt, tools=TOOLS)  # type: ignore[arg-type]
    streamed = _streamed(fmt, _cut(text, cuts))
    assert _summary(*streamed) == _summary(*unary)
    assert [c.arguments for c in streamed[1]] == [c.arguments for c in unary[1]]  # the same text


# JSON values as arguments: written as the model writes calls, read back the same, in any pieces
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_name = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
_calls = st.lists(st.tuples(_name, st.dictionaries(_name, _json, max_size=3)), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(
    calls=_calls,
    before=st.sampled_from(["", " ", "\n<|python_start|>"]),
    cuts=st.lists(st.integers(1, 400), max_size=10),
)
def test_pythonic_call_lists_read_back_in_any_fragments(calls: Calls, before: str, cuts: list[int]) -> None:
    text = before + pythonic_text(calls)
    content, got = _streamed("pythonic", _cut(text, cuts))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == calls


_texts = st.text(alphabet=st.sampled_from("ab <>/=\n\"'{}[]_"), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    name=_name,
    params=st.dictionaries(_name, _texts, max_size=3),
    before=_texts,
    after=_texts,
    cuts=st.lists(st.integers(1, 300), max_size=10),
)
def test_qwen_calls_with_any_text_around_in_any_fragments(
    name: str, params: dict[str, str], before: str, after: str, cuts: list[int]
) -> None:
    """Whatever text comes around a call (and in its string values): the stream is the unary
    result; with plain text around, the call and the text are read back."""
    text = before + qwen_text(name, params) + after
    streamed = _streamed("qwen3_coder", _cut(text, cuts), tools=())
    unary = parse(text, "qwen3_coder")
    assert _summary(*streamed) == _summary(*unary)
    if not any(c in before + after for c in "<>") and not any("</parameter>" in v for v in params.values()):
        assert _summary(*unary)[1] == [(name, params)]


def test_text_is_held_only_while_it_may_be_a_call() -> None:
    parser = ToolCallParser("pythonic")
    assert parser.feed("  ") == [] and parser.feed("[get_") == [] and parser.feed("weather(") == []
    assert parser.feed('city="x")') == []  # inside the list: held until it closes
    assert [type(e) for e in parser.feed("]")] == [ToolCall]
    assert ToolCallParser("pythonic").feed("[1") == ["[1"]  # not "[name(": content at once
    assert ToolCallParser("pythonic").feed("Sure") == ["Sure"]
    assert ToolCallParser("pythonic").feed("<|python_st") == []
    qwen = ToolCallParser("qwen3_coder")
    assert qwen.feed("Hello <tool") == ["Hello"]  # " <tool" may start a call
    assert qwen.feed("box> and") == [" <toolbox> and"]
    assert qwen.feed(" <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n") == []
    assert qwen.feed("Oops") == []  # (a value may hold "</parameter>": still undecided)
    assert [type(e) for e in qwen.feed("\n</parameter>\n</function>\n</tool_call>")] == [ToolCall]


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),
        ("three", {"type": "integer"}, "three"),
        ("2.5", {"type": "number"}, 2.5),
        ("true", {"type": "number"}, "true"),
        ("False", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("{'a': None}", {"type": "object"}, {"a": None}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("[1, 'x']", {"type": "array"}, [1, "x"]),
        ("null", {"type": "integer"}, None),
        ("null", {"type": "string"}, "null"),
        ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
        ("7", {"type": ["integer", "null"]}, 7),
        ("7", {"type": "string"}, "7"),
        ("7", {"enum": ["7"]}, "7"),
        ("  spaced  ", {"type": "string"}, "  spaced  "),
    ],
)
def test_qwen_values_are_typed_by_the_tools_schema(raw: str, schema: dict[str, Any], value: Any) -> None:
    tool = Tool("f", "", json.dumps({"type": "object", "properties": {"p": schema}}))
    (call,) = parse(_qwen("f", ("p", raw)), "qwen3_coder", tools=(tool,))[1]
    assert json.loads(call.arguments) == {"p": value}
    # a tool not offered, or a parameter its schema does not name: the text as it is
    assert json.loads(parse(_qwen("f", ("p", raw)), "qwen3_coder")[1][0].arguments) == {"p": raw}
    assert json.loads(parse(_qwen("f", ("q", raw)), "qwen3_coder", tools=(tool,))[1][0].arguments) == {
        "q": raw
    }


def test_earlier_calls_are_written_as_the_model_writes_them_and_read_back() -> None:
    calls = [("get_weather", '{"city": "Paris", "days": 3, "opts": {"a": [true, null]}}'), ("ping", "{}")]
    for fmt in ("pythonic", "qwen3_coder"):
        text = calls_text(calls, fmt)
        content, got = parse(text, fmt, tools=TOOLS)
        assert content is None
        assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, json.loads(a)) for n, a in calls]
    assert calls_text(calls, "pythonic").count("[") == 2  # one list (and the inner one)
    assert call_text("ping", "{}", "pythonic") == "[ping()]"
    assert python_literal({"a": [True, None, 1.5, 'q"']}) == '{"a": [True, None, 1.5, "q\\""]}'
    assert tool_result_text("sunny", "qwen3_coder") == "<tool_response>\nsunny\n</tool_response>"
    assert tool_result_text("sunny", "pythonic") == "sunny"
    assert "[func_name1(" in preamble(TOOLS, "pythonic") and '"get_weather"' in preamble(TOOLS, "pythonic")
    assert "<function=" in preamble(TOOLS, "qwen3_coder") and '"get_weather"' in preamble(
        TOOLS, "qwen3_coder"
    )


@pytest.mark.parametrize("fmt", ["pythonic", "qwen3_coder"])
def test_a_forced_call_is_its_json_body_as_in_every_format(fmt: str) -> None:
    """tool_choice required / named: the grammar writes the call's JSON body (as vLLM forces
    calls in every format); the parser reads it as the call, its arguments streamed."""
    schema = json.loads(forced_call(TOOLS, fmt).spec)  # type: ignore[arg-type]
    assert schema["required"] == ["name", "arguments"]
    body = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    content, calls = parse(body, fmt, forced=True, tools=TOOLS)  # type: ignore[arg-type]
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})
    ]


QWEN3_CODER_TEMPLATE = (
    "{%- for tool_call in message.tool_calls %}{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}"
)
QWEN25_TEMPLATE = (
    '{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" }}'
)
LLAMA32_PYTHONIC = (
    "{{- 'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), "
    'func_name2(params)] \' }}{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
)
LLAMA4_PYTHONIC = (
    "- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\n <|python_start|>"
)
LLAMA32_JSON = (
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    'arguments that best answers the given prompt.\\n\\n\' }}{{- \'{"name": function name, "parameters": '
    "dictionary of argument name and its value}.' }}<|start_header_id|>ipython<|end_header_id|>"
)


def test_formats_are_detected_from_the_chat_template_only_when_sure() -> None:
    assert detect_format(QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    assert detect_format(QWEN25_TEMPLATE) == "hermes"  # <tool_call> with JSON inside
    assert detect_format(LLAMA32_PYTHONIC) == "pythonic"
    assert detect_format(LLAMA4_PYTHONIC) == "pythonic"
    assert detect_format(LLAMA32_JSON) == "llama3_json"  # Meta's own Llama 3.2 template asks for JSON
    assert detect_format("{{ message['content'] }} [") == "hermes"
    assert detect_format("<function=x> alone") == "hermes"
