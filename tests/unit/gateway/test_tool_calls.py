"""The tool-call parsers (Hermes and Llama-3 JSON, free and forced): whole outputs and the same
outputs fed in every kind of fragment give the same content and calls; text around calls stays
content; what does not parse stays content; a forced call's arguments stream piecewise; the
forcing schema and the prompt preamble."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from services.gateway.tool_calls import (
    ArgumentsDelta,
    CallStart,
    Tool,
    ToolCall,
    ToolCallParser,
    call_text,
    detect_format,
    forced_call,
    parse,
    preamble,
    template_call_id,
)
from shared.structured_output import grammar_of

WEATHER = Tool(
    "get_weather",
    "Weather in a city",
    json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)

# (format, forced, output, expected content, expected (name, arguments) calls)
CASES: list[tuple[str, bool, str, str | None, list[tuple[str, dict[str, object]]]]] = [
    (
        "hermes",
        False,
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo 🙂"}}\n</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Oslo 🙂"}), ("f", {})],
    ),
    (
        "hermes",
        False,
        'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> then more',
        "a then more",
        [("f", {"x": 1})],
    ),
    ("hermes", False, "no calls here, just < and <tool", "no calls here, just < and <tool", []),
    (
        "hermes",
        False,
        "x <tool_call>{not json}</tool_call> y",
        "x <tool_call>{not json}</tool_call> y",
        [],
    ),
    (
        "hermes",
        False,
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        False,
        '<tool_call>{"name": "f", "arguments": {"s": "</tool"}}',
        None,
        [("f", {"s": "</tool"})],
    ),
    ("hermes", False, '<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    (
        "hermes",
        False,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>',
        None,
        [("f", {"a": 2})],
    ),
    ("hermes", True, '{"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
    (
        "llama3_json",
        False,
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", {"x": 1}), ("g", {})],
    ),
    ("llama3_json", False, ' {"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ("llama3_json", False, 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    ("llama3_json", False, '{"name": "f", "parameters": {"x": 1', '{"name": "f", "parameters": {"x": 1', []),
    ("llama3_json", False, '{"city": "Oslo"}', '{"city": "Oslo"}', []),
    ("llama3_json", False, "<|python_ta", "<|python_ta", []),
    ("llama3_json", True, '{"name": "f", "parameters": {}}', None, [("f", {})]),
    # Mistral, its special tokens left out by the workers (v3: an array; v11: name{...})
    (
        "mistral",
        False,
        ' [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "f", "arguments": {}}]',
        None,
        [("get_weather", {"city": "Oslo"}), ("f", {})],
    ),
    ("mistral", False, '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]', None, [("f", {"x": 1})]),
    (
        "mistral",
        False,
        'get_weather{"city": "Oslo"}f[ARGS]{}',
        None,
        [("get_weather", {"city": "Oslo"}), ("f", {})],
    ),
    ("mistral", False, '[TOOL_CALLS]f[ARGS]{"x": [1]}', None, [("f", {"x": [1]})]),
    ("mistral", False, '{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("mistral", False, "Paris", "Paris", []),
    ("mistral", False, "Hello there, no calls [TOOL", "Hello there, no calls [TOOL", []),
    ("mistral", False, "[1, 2] is a list", "[1, 2] is a list", []),
    ("mistral", False, '[{"name": "f", "arguments": {"a": 1}', '[{"name": "f", "arguments": {"a": 1}', []),
    ("mistral", True, '{"name": "f", "arguments": {}}', None, [("f", {})]),
    # Mistral with its markers shown (skip_special_tokens false): a call after some content
    (
        "mistral",
        False,
        'Let me check. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]',
        "Let me check.",
        [("f", {"x": 1})],
    ),
    ("mistral", False, 'Sure![TOOL_CALLS]f[ARGS]{"x": 2}', "Sure!", [("f", {"x": 2})]),
    ("mistral", False, 'A[TOOL_CALLS]{"name": "f", "arguments": {}} B', "A B", [("f", {})]),
    # a marker not followed by a call is content, and the next one is still read
    (
        "mistral",
        False,
        'x [TOOL_CALLS] oops [TOOL_CALLS][{"name": "g", "arguments": {}}]',
        "x [TOOL_CALLS] oops",
        [("g", {})],
    ),
    ("mistral", False, "just text [TOOL_CALLS]", "just text [TOOL_CALLS]", []),
    ("mistral", False, "ends with [TOOL_CA", "ends with [TOOL_CA", []),
]


def _summary(content: str | None, calls: list[ToolCall]) -> tuple[str | None, list[tuple[str, object]]]:
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "forced", "text", "content", "calls"), CASES)
def test_whole_output(
    fmt: str, forced: bool, text: str, content: str | None, calls: list[tuple[str, object]]
) -> None:
    got_content, got_calls = parse(text, fmt, forced)  # type: ignore[arg-type]
    assert _summary(got_content, got_calls) == (content, calls)
    if fmt == "mistral":  # the ids Mistral's templates accept back
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in got_calls)
    else:
        assert all(c.id.startswith("call_") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("fmt", "forced", "text", "content", "calls"), CASES)
def test_fragments_give_the_whole_output_result(
    fmt: str, forced: bool, text: str, content: str | None, calls: list[tuple[str, object]]
) -> None:
    """Fed one character at a time, and cut at random places: the same content and calls, each
    call whole (its arguments one JSON object), in order."""
    rng = random.Random(len(text))
    cuttings = [list(text)] + [
        _cut(text, sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))))
        for _ in range(30)
    ]
    for pieces in cuttings:
        parser = ToolCallParser(fmt, forced)  # type: ignore[arg-type]
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        got_calls = [e for e in events if isinstance(e, ToolCall)]
        got_content = "".join(e for e in events if isinstance(e, str))
        assert _summary((got_content or None) if got_calls else got_content, got_calls) == (content, calls)
        assert parser.num_calls == len(calls)


def _cut(text: str, at: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


def test_text_is_not_held_longer_than_needed() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <tool") == ["Hello"]  # " <tool" may start a call
    assert parser.feed("box> and") == [" <toolbox> and"]
    llama = ToolCallParser("llama3_json")
    assert llama.feed("Sure") == ["Sure"]


FORCED_BODY = '{"name": "get_weather", "arguments": {"city": "Os\\"lo {}", "days": [1, {"x": "]"}]}}'


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_a_forced_calls_arguments_stream_as_they_are_written(fmt: str) -> None:
    """Fed a character at a time: CallStart once the name is written, then arguments deltas
    while they are written (escapes, braces and brackets inside strings included), whose
    concatenation is the final call's arguments, the same id, exactly the unary result; the
    object's closing brace is not part of them."""
    body = FORCED_BODY.replace('"arguments"', '"parameters"') if fmt == "llama3_json" else FORCED_BODY
    parser = ToolCallParser(fmt, forced=True)  # type: ignore[arg-type]
    events = [(i, e) for i, ch in enumerate(body) for e in parser.feed(ch)] + [
        (len(body), e) for e in parser.finish()
    ]
    starts = [(i, e) for i, e in events if isinstance(e, CallStart)]
    deltas = [(i, e) for i, e in events if isinstance(e, ArgumentsDelta)]
    calls = [(i, e) for i, e in events if isinstance(e, ToolCall)]
    assert [e.name for _, e in starts] == ["get_weather"] and len(calls) == 1
    assert starts[0][0] == body.index("{", 1)  # as soon as the arguments' opening brace comes
    assert len(deltas) > 10 and deltas[-1][0] < calls[0][0]  # sent before the call completes
    call = calls[0][1]
    assert call.id == starts[0][1].id
    assert "".join(e.text for _, e in deltas) == call.arguments == body[body.index("{", 1) : -1]
    assert json.loads(call.arguments) == {"city": 'Os"lo {}', "days": [1, {"x": "]"}]}
    _, whole = parse(body, fmt, forced=True)  # type: ignore[arg-type]
    assert [(c.name, c.arguments) for c in whole] == [(call.name, call.arguments)]
    # cut short (max_tokens): still the call, with the arguments written so far, unary alike
    cut = body[:-12]
    parser = ToolCallParser(fmt, forced=True)  # type: ignore[arg-type]
    events2 = [e for ch in cut for e in parser.feed(ch)] + parser.finish()
    sent = "".join(e.text for e in events2 if isinstance(e, ArgumentsDelta))
    assert [(e.name, e.arguments) for e in events2 if isinstance(e, ToolCall)] == [("get_weather", sent)]
    assert not [e for e in events2 if isinstance(e, str)]
    content, calls2 = parse(cut, fmt, forced=True)  # type: ignore[arg-type]
    assert content is None and [(c.name, c.arguments) for c in calls2] == [("get_weather", sent)]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_forced_call_schema_accepts_only_calls_of_the_tools(fmt: str) -> None:
    other = Tool("add", "", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    key = "parameters" if fmt == "llama3_json" else "arguments"
    one = forced_call((WEATHER,), fmt)  # type: ignore[arg-type]
    either = forced_call((WEATHER, other), fmt)  # type: ignore[arg-type]
    assert grammar_of(one) and grammar_of(either)  # compiles
    call = {"name": "get_weather", key: {"city": "Oslo"}}
    jsonschema.validate(call, json.loads(one.spec))
    jsonschema.validate({"name": "add", key: {"a": 1}}, json.loads(either.spec))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", key: {"a": 1}}, json.loads(one.spec))
    content, calls = parse(json.dumps(call), fmt, forced=True)  # type: ignore[arg-type]
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]


def test_preamble_call_text_and_detection() -> None:
    hermes = preamble((WEATHER,), "hermes")
    assert "<tools>" in hermes and '"get_weather"' in hermes and "<tool_call>" in hermes
    assert '"parameters"' in preamble((WEATHER,), "llama3_json")
    assert parse(call_text("f", '{"a": 1}', "hermes"), "hermes")[1][0].arguments == '{"a": 1}'
    assert parse(call_text("f", '{"a": 1}', "llama3_json"), "llama3_json")[1][0].name == "f"
    assert detect_format("... <tool_call> ...") == "hermes"
    assert detect_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_format("{{ message['content'] }}") == "hermes"
    assert detect_format("{{ '[TOOL_CALLS] ' + calls|tojson }}") == "mistral"
    assert parse(call_text("f", '{"a": 1}', "mistral"), "mistral")[1][0].arguments == '{"a": 1}'
    assert '"arguments"' in preamble((WEATHER,), "mistral")


def test_mistral_template_ids_are_9_letters_and_digits_and_stable() -> None:
    assert template_call_id("call_0123456789abcdef", "mistral") == "789abcdef"
    assert template_call_id("abc123XYZ", "mistral") == "abc123XYZ"
    short = template_call_id("t-1", "mistral")
    assert re.fullmatch(r"[0-9a-f]{9}", short) and short == template_call_id("t-1", "mistral")
    assert template_call_id("t-1", "mistral") != template_call_id("t-2", "mistral")
    assert template_call_id("call_x", "hermes") == "call_x"
