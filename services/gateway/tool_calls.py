"""Tool calls: the tools a chat request offers, the tool_choice that forces a call (as a JSON-schema
structured output), the prompt preamble for templates that ignore tools, and the parsers that turn
a model's output into content and tool calls (Hermes `<tool_call>` JSON, Llama-3 JSON, Mistral's
`[TOOL_CALLS]`, the pythonic call list of Llama 3.2 / 4, Qwen3-Coder's XML), one incremental
parser for streamed and unary responses alike (unary = all text fed at once, so a stream's deltas
always reassemble to the unary result). The pythonic and Qwen3-Coder syntaxes are read and written
by tool_call_syntax.py.

Mistral: `[TOOL_CALLS]` (and v11's `[ARGS]`) are special tokens. The gateway asks the workers to
show them for such requests (`skip_special_tokens` false, as vLLM's Mistral parser does), so a
call is read after a `[TOOL_CALLS]` wherever it comes, after some content too; a worker that hides
them (older than 1.14) leaves what remains, read at the start of the output. Either way a call is
a JSON array of call objects (v3 tokenizers: `[TOOL_CALLS] [{"name": ..., "arguments": {...}},
...]`), or one or more `name{arguments}` (v11: `[TOOL_CALLS]name[ARGS]{...}`). Mistral's
templates accept only tool call ids of 9 letters and digits: calls parsed in this format get such
ids, and the ids of earlier calls a client sends back are mapped to such ids the same way in the
assistant message and in the tool message answering it."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.tool_call_syntax import (
    NEED_MORE,
    PYTHON_END,
    PYTHON_START,
    PYTHONIC_HEAD,
    PYTHONIC_HEAD_SO_FAR,
    QWEN_START,
    PythonListScanner,
    QwenCall,
    pythonic_calls,
    pythonic_text,
    qwen_call,
    qwen_text,
    typed_value,
)
from shared.structured_output import StructuredOutput

Format = Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
FORMATS: tuple[Format, ...] = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a JSON call with it
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function name rule (plus '.')
# Mistral v11: a function name, [ARGS] where it is shown, then the arguments' object
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.-]{1,64})(?:\[ARGS\])?\s*(?=\{)")
_MISTRAL_NAME_SO_FAR = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:\[(?:A(?:R(?:G(?:S\]?)?)?)?)?)?\s*")


@dataclass(frozen=True)
class Tool:
    """One function the model may call; `parameters` is its JSON schema (JSON text)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def as_openai(self) -> dict[str, Any]:
        """The {"type": "function", "function": {...}} dict chat templates expect."""
        function: dict[str, Any] = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `arguments` is a JSON object as text (compact json.dumps)."""

    id: str
    name: str
    arguments: str


def new_call_id(fmt: Format = "hermes") -> str:
    """A call's id: OpenAI's form, or 9 letters and digits where Mistral's templates require it."""
    if fmt == "mistral":
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def template_call_id(call_id: str, fmt: Format) -> str:
    """An earlier call's id as the chat template gets it: unchanged, except for Mistral's (9
    letters and digits): the id's last 9 letters and digits, or, when it has fewer, a digest of
    it; the same id maps to the same result in the assistant and the tool message."""
    if fmt != "mistral":
        return call_id
    kept = re.sub(r"[^A-Za-z0-9]", "", call_id)
    if len(kept) >= 9:
        return kept[-9:]
    return hashlib.sha1(call_id.encode()).hexdigest()[:9]


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


def detect_format(chat_template: str) -> Format:
    """The parser a chat template's own tool format calls for (hermes when it says nothing):
    Qwen3-Coder's writes calls with `<function=` and `<parameter=` (inside `<tool_call>`, so it is
    looked for first); the pythonic templates of Llama 3.2 / 4 (vLLM's) show the call list as
    `[func_name1(...), ...]`. (Meta's own Llama 3.2 / 4 templates ask for JSON: llama3_json.)"""
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "[func_name1(" in chat_template:
        return "pythonic"
    if HERMES_START in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    if MISTRAL_CALLS in chat_template:
        return "mistral"
    return "hermes"


def arguments_key(fmt: Format) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"


def forced_call(tools: tuple[Tool, ...], fmt: Format) -> StructuredOutput:
    """The structured output that forces exactly one call of one of `tools` (tool_choice
    `required`: any of them; a named function: that one). It is the call's JSON body in the
    parser's format ({"name": ..., "arguments"|"parameters": {...}}) without Hermes' tags, which
    a JSON schema cannot write (vLLM forces calls the same way); the parser reads it as a call."""
    key = arguments_key(fmt)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: json.loads(t.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return StructuredOutput("json_schema", json.dumps(schema))


def preamble(tools: tuple[Tool, ...], fmt: Format) -> str:
    """A system-prompt text offering `tools`, for chat templates that do not render tools (the
    bundled SmolLM2's): the Hermes function-calling prompt (NousResearch's), or its counterpart in
    the other formats."""
    listed = "\n".join(json.dumps(t.as_openai()) for t in tools)
    if fmt == "pythonic":
        return (
            "You have access to the following functions. To call functions, respond with only a "
            "python list of the calls, in the format [func_name1(params_name1=params_value1, "
            "params_name2=params_value2...), func_name2(params)]. Do not use variables.\n\n" + listed
        )
    if fmt == "qwen3_coder":
        return (
            "You have access to the following functions:\n\n<tools>\n" + listed + "\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format:\n\n<tool_call>\n"
            "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n</function>\n</tool_call>"
        )
    if fmt == "llama3_json":
        return (
            "You have access to the following functions. To call a function, respond with only a JSON "
            'object of the form {"name": function name, "parameters": {argument name: value}}.\n\n' + listed
        )
    if fmt == "mistral":
        return (
            "You have access to the following functions. To call functions, respond with only a JSON "
            'array of objects of the form {"name": function name, "arguments": {argument name: value}}.'
            "\n\n" + listed
        )
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
        "Don't make assumptions about what values to plug into functions.\n<tools>\n"
        + listed
        + "\n</tools>\nFor each function call return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def call_text(name: str, arguments: str, fmt: Format) -> str:
    """An earlier assistant call as the model writes it (for templates that do not render calls)."""
    if fmt == "pythonic":
        return pythonic_text([(name, json.loads(arguments))])
    if fmt == "qwen3_coder":
        return qwen_text(name, json.loads(arguments))
    body = f'{{"name": {json.dumps(name)}, "{arguments_key(fmt)}": {arguments}}}'
    if fmt == "mistral":
        return f"{MISTRAL_CALLS} [{body}]"
    return f"{HERMES_START}\n{body}\n{HERMES_END}" if fmt == "hermes" else body


def calls_text(calls: Sequence[tuple[str, str]], fmt: Format) -> str:
    """An earlier assistant turn's calls, (name, arguments) each, as the model writes them: one
    pythonic list, or each call in turn."""
    if fmt == "pythonic":
        return pythonic_text([(name, json.loads(arguments)) for name, arguments in calls])
    return "\n".join(call_text(name, arguments, fmt) for name, arguments in calls)


def tool_result_text(content: str, fmt: Format) -> str:
    wrapped = fmt in ("hermes", "qwen3_coder")
    return f"<tool_response>\n{content}\n</tool_response>" if wrapped else content


def _call_of(body: str) -> ToolCall | None:
    """A call's JSON body -> ToolCall, or None when it is not one (bad JSON, no name, arguments
    that are not an object)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of_object(obj)


def _call_of_object(obj: Any, fmt: Format = "hermes") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(fmt), obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class CallStart:
    """A forced call's id and name, known before its arguments are complete (streaming)."""

    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next piece of the open call's arguments, as the model wrote them."""

    text: str


# content text; a complete call (after its CallStart and ArgumentsDeltas when it was streamed
# piecewise: then its arguments are their concatenation and its id the CallStart's)
Event = str | ToolCall | CallStart | ArgumentsDelta

# the head of a forced call's body up to its arguments' value: {"name": "<name>", "arguments": (or
# "parameters"), in the order the call's schema writes them; a JSON string's escapes allowed
_FORCED_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


@dataclass
class _OpenCall:
    """A forced call streamed piecewise: its id, where its arguments start in the body, how far
    they are sent, and the scan state of the arguments' JSON (nesting depth, inside a string)."""

    id: str
    name: str
    args_start: int
    scanned: int = 0  # characters of the arguments scanned (and so sent)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    closed: bool = False  # the arguments' closing brace was seen (scanned: their length)

    def advance(self, args: str) -> None:
        """Scan `args` (the body from args_start) from `scanned` on, up to the object's end."""
        while not self.closed and self.scanned < len(args):
            c = args[self.scanned]
            self.scanned += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True


class ToolCallParser:
    """Splits a model's output into content and tool calls, fed in any fragments.

    `feed(text)` and `finish()` return what is certain so far, in order: content strings and
    complete ToolCalls. Text that may start a call is held back until it is known. A call that
    does not parse (bad JSON, no name) is content, as written. Whitespace right before a call, and
    at the end after the last call, is dropped (content is what the model said around its calls).

    Hermes: calls are `<tool_call>{json}</tool_call>` anywhere in the text (an unterminated call
    at the end counts when its JSON is complete). Llama-3 JSON, and a call forced by tool_choice
    (`forced`: the bare JSON body in either format): the output opens with a JSON object
    (optionally after `<|python_tag|>`), calls may follow each other separated by `;` or
    whitespace; output that does not open with `{` is content. Mistral (module docstring): the
    same, and at the output's start or after a call also a JSON array of calls or `name{...}`.

    Pythonic: the output opens (after whitespace, and Llama 4's `<|python_start|>` where shown)
    with a Python list of calls, `[name(arg=literal, ...), ...]`; it is held until the list
    closes, then its calls are sent together (none is sent before the whole list is known to be
    calls); a list that is not one, or output that does not open with `[name(`, is content as
    written. Text after the list (past `<|python_end|>`) is content. Qwen3-Coder: calls are
    `<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>`
    anywhere in the text, as Hermes' calls are; a value is typed by the parameter's type in the
    tool's schema (`tools`; tool_call_syntax.typed_value), else a string. A block that is not a
    call leaves its `<tool_call>` as content and the search goes on after it.
    """

    def __init__(self, fmt: Format, forced: bool = False, tools: Sequence[Tool] = ()) -> None:
        self._fmt = fmt
        self._mistral = fmt == "mistral"
        self._json_calls = forced or fmt in ("llama3_json", "mistral")
        self._pythonic = fmt == "pythonic" and not forced
        self._qwen = fmt == "qwen3_coder" and not forced
        self._tools = tuple(tools)
        self._properties: dict[str, dict[str, Any]] | None = None  # per tool (Qwen3-Coder typing)
        self._list: PythonListScanner | None = None  # pythonic: scanning the call list
        self._after_list = False  # pythonic: the call list was read; the rest is content
        # a forced call (the grammar makes the output one) streams its arguments as they come
        self._forced = forced
        self._open: _OpenCall | None = None
        self._buf = ""  # text not yet decided
        self._in_call = False  # _buf holds (the start of) a call's body
        self._plain = False  # JSON mode only: the output is plain text from here on
        self._expect_call = True  # JSON mode only: at the start, or just after a call
        self._after_call = False  # nothing but whitespace since the last call
        self._held_ws = ""  # content's trailing whitespace, dropped if a call follows
        self._call_start = 0  # where in _buf the call's JSON starts (JSON mode)
        # Mistral: _buf (after whitespace) opens with a shown [TOOL_CALLS] being read as calls;
        # when they fail, that marker is content and the next one is searched past it
        self._failed_marker = False
        self.num_calls = 0

    # --- content with whitespace next to calls dropped ---
    def _content(self, text: str, out: list[Event]) -> None:
        full = self._held_ws + text
        body = full.rstrip()
        self._held_ws = full[len(body) :]
        if body:
            self._after_call = False
            out.append(body)

    def _call(self, call: ToolCall, out: list[Event]) -> None:
        self._failed_marker = False
        self._held_ws = ""
        self._after_call = True
        self.num_calls += 1
        out.append(call)

    # --- feeding ---
    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        self._scan(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._scan(out, final=True)
        if self._buf:
            self._content(self._buf, out)
            self._buf = ""
        if self._held_ws and not self._after_call:  # (whitespace after the last call: dropped)
            out.append(self._held_ws)
        self._held_ws = ""
        return out

    def _scan(self, out: list[Event], final: bool) -> None:
        if self._json_calls:
            self._scan_json(out, final)
        elif self._pythonic:
            self._scan_pythonic(out, final)
        elif self._qwen:
            self._scan_qwen(out, final)
        else:
            self._scan_hermes(out, final)

    def _scan_pythonic(self, out: list[Event], final: bool) -> None:
        if self._after_list and not self._plain:  # Llama 4's <|python_end|> closes the calls
            head = self._buf.lstrip()
            if not final and PYTHON_END.startswith(head):
                return  # (nothing yet, or the start of the marker)
            if head.startswith(PYTHON_END):
                self._buf = head[len(PYTHON_END) :]
            self._plain = True
        if not self._plain and self._list is None:
            head = self._buf.lstrip()
            if head.startswith(PYTHON_START):
                head = head[len(PYTHON_START) :].lstrip()
            elif not final and PYTHON_START.startswith(head):
                return  # undecided: whitespace, or the start of <|python_start|>
            if PYTHONIC_HEAD.match(head):
                self._list = PythonListScanner()
                self._call_start = len(self._buf) - len(head)
            elif not final and (not head or PYTHONIC_HEAD_SO_FAR.fullmatch(head)):
                return  # may still become "[name("
            else:
                self._plain = True
        if self._list is not None and not self._plain:
            body = self._buf[self._call_start :]
            end = self._list.advance(body, final)
            if end is None and not final:
                return
            calls = pythonic_calls(body[:end]) if end is not None else None
            if end is not None and calls is not None and all(valid_name(name) for name, _ in calls):
                for name, arguments in calls:
                    self._call(ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False)), out)
                self._buf, self._list, self._after_list = body[end:], None, True
                self._scan_pythonic(out, final)
                return
            self._plain = True  # not a call list (or never closed): all of it is content
        if self._buf:
            self._content(self._buf, out)
            self._buf = ""

    def _to_marker(self, marker: str, out: list[Event], final: bool) -> bool:
        """The text before `marker` as content; True when the buffer now starts with it (a call
        begins), False when it is not there (only what may be its start is kept back)."""
        at = self._buf.find(marker)
        if at < 0:
            keep = 0 if final else _partial_suffix(self._buf, marker)
            self._content(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._content(self._buf[:at], out)
        self._buf = self._buf[at:]
        return True

    def _scan_qwen(self, out: list[Event], final: bool) -> None:
        while self._buf:
            if not self._in_call:
                if not self._to_marker(QWEN_START, out, final):
                    return
                self._in_call = True
            found = qwen_call(self._buf, final)
            if found == NEED_MORE:
                return
            self._in_call = False
            if isinstance(found, QwenCall) and (call := self._qwen_call(found)) is not None:
                self._call(call, out)
                self._buf = self._buf[found.end :]
            else:  # not a call: its <tool_call> is content
                self._content(QWEN_START, out)
                self._buf = self._buf[len(QWEN_START) :]

    def _qwen_call(self, found: QwenCall) -> ToolCall | None:
        """A Qwen3-Coder block's call, its values typed by the tool's schema (when it is one of
        the tools offered); None when its name is not a function name."""
        if not valid_name(found.name):
            return None
        if self._properties is None:
            self._properties = {t.name: _properties(t) for t in self._tools}
        properties = self._properties.get(found.name, {})
        arguments = {name: typed_value(value, properties.get(name)) for name, value in found.parameters}
        return ToolCall(new_call_id(), found.name, json.dumps(arguments, ensure_ascii=False))

    def _scan_hermes(self, out: list[Event], final: bool) -> None:
        while self._buf:
            if not self._in_call:
                if not self._to_marker(HERMES_START, out, final):
                    return
                self._in_call = True
            end = self._buf.find(HERMES_END)
            if end < 0:
                if final:  # unterminated: a call if its JSON is complete
                    self._in_call = False
                    call = _call_of(self._buf[len(HERMES_START) :])
                    if call is not None:
                        self._call(call, out)
                        self._buf = ""
                return
            raw = self._buf[: end + len(HERMES_END)]
            self._buf = self._buf[len(raw) :]
            self._in_call = False
            call = _call_of(raw[len(HERMES_START) : end])
            if call is None:
                self._content(raw, out)
            else:
                self._call(call, out)

    def _scan_json(self, out: list[Event], final: bool) -> None:
        while self._buf:
            if self._plain:
                if self._mistral and not self._forced:
                    if self._to_mistral_marker(out, final):
                        continue  # content up to a shown [TOOL_CALLS]: calls may follow it
                    return
                self._content(self._buf, out)
                self._buf = ""
                return
            if not self._in_call:
                head = self._buf.lstrip()
                if self.num_calls:
                    head = head.lstrip("; \t\r\n")
                if not head or (not final and PYTHON_TAG.startswith(head)):
                    return  # undecided: whitespace, or the start of <|python_tag|>
                if head.startswith(PYTHON_TAG) and self.num_calls == 0:
                    head = head[len(PYTHON_TAG) :].lstrip()
                    if not head:
                        return
                if self._mistral and not self._forced:
                    if head.startswith(MISTRAL_CALLS):
                        # a shown marker: what follows is read as calls (a bare object too);
                        # if it is none, the marker is content and the search goes on after it
                        self._failed_marker = True
                        head = head[len(MISTRAL_CALLS) :].lstrip()
                        if not head and not final:
                            return
                    decided = self._scan_mistral(head, out, final)
                    if decided is None:
                        return  # undecided: wait for more text
                    if decided:
                        continue  # calls taken from _buf
                if not head.startswith("{"):
                    self._plain = True
                    continue
                self._in_call = True
                self._call_start = len(self._buf) - len(head)
            body = self._buf[self._call_start :]
            if self._forced:
                self._stream_forced(body, out)
            try:
                obj, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                if final and self._open is not None:  # a streamed call cut short (max_tokens):
                    cut, self._open = self._open, None  # a call with the arguments written
                    self._buf, self._in_call = "", False
                    self._call(ToolCall(cut.id, cut.name, body[cut.args_start :]), out)
                    return
                if final:  # never completed: all of it is content
                    self._in_call = False
                    self._plain = True
                    continue
                return
            call = _call_of_object(obj, self._fmt)
            if call is None:
                self._in_call = False
                self._plain = True
                continue
            opened, self._open = self._open, None
            if opened is not None and opened.closed:  # streamed: as sent
                call = ToolCall(
                    opened.id, call.name, body[opened.args_start : opened.args_start + opened.scanned]
                )
            self._buf = body[end:]
            self._in_call = False
            self._call(call, out)

    def _to_mistral_marker(self, out: list[Event], final: bool) -> bool:
        """Plain text in Mistral's format: the content before a shown `[TOOL_CALLS]` is sent and
        True returned (a call position again: _buf starts with the marker). Without one, False
        with _buf's text sent, except a possible start of the marker at its end (held back while
        more may come)."""
        # past a marker whose text turned out not to be calls (it stays content)
        start = self._buf.find(MISTRAL_CALLS) + len(MISTRAL_CALLS) if self._failed_marker else 0
        self._failed_marker = False
        at = self._buf.find(MISTRAL_CALLS, start)
        if at < 0:
            keep = 0 if final else _partial_suffix(self._buf, MISTRAL_CALLS)
            self._content(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._content(self._buf[:at], out)
        self._buf = self._buf[at:]
        self._plain = False
        return True

    def _scan_mistral(self, head: str, out: list[Event], final: bool) -> bool | None:
        """At a call position of Mistral's format: True when calls were taken (a JSON array of
        calls, or `name{arguments}`; _buf then holds what follows), False when `head` is none
        of those (the JSON-mode rules go on: a bare object is a call, anything else content),
        None when it cannot tell yet."""
        if not final and MISTRAL_CALLS.startswith(head):
            return None  # the start of a shown [TOOL_CALLS]
        if head.startswith(MISTRAL_CALLS):
            head = head[len(MISTRAL_CALLS) :].lstrip()
            if not head:
                return None if not final else False
        decoder = json.JSONDecoder()
        if head.startswith("["):
            try:
                arr, end = decoder.raw_decode(head)
            except json.JSONDecodeError:
                return False if final else None
            calls = [_call_of_object(o, "mistral") for o in arr] if isinstance(arr, list) else []
            if not calls or any(c is None for c in calls):
                return False
            for call in calls:
                assert call is not None
                self._call(call, out)
            self._buf = head[end:]
            return True
        named = _MISTRAL_NAMED.match(head)
        if named is None:
            partial = _MISTRAL_NAME_SO_FAR.fullmatch(head)
            return None if partial is not None and not final else False
        try:
            args, end = decoder.raw_decode(head, named.end())
        except json.JSONDecodeError:
            return False if final else None
        if not isinstance(args, dict):
            return False
        arguments = json.dumps(args, ensure_ascii=False)
        self._call(ToolCall(new_call_id("mistral"), named.group(1), arguments), out)
        self._buf = head[end:]
        return True

    def _stream_forced(self, body: str, out: list[Event]) -> None:
        """A forced call's CallStart once its name is written, then each new piece of its
        arguments (a grammar guarantees the call completes, so nothing sent is taken back)."""
        if self._open is None:
            head = _FORCED_HEAD.match(body)
            if head is None:
                return
            self._open = _OpenCall(new_call_id(self._fmt), json.loads(head.group(1)), head.end())
            out.append(CallStart(self._open.id, self._open.name))
        call = self._open
        args = body[call.args_start :]
        sent = call.scanned
        call.advance(args)
        if call.scanned > sent:
            out.append(ArgumentsDelta(args[sent : call.scanned]))


def _properties(tool: Tool) -> dict[str, Any]:
    """A tool's parameters' schemas by name (its schema's `properties`)."""
    schema = json.loads(tool.parameters)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse(
    text: str, fmt: Format, forced: bool = False, tools: Sequence[Tool] = ()
) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, calls). Content is None when there are calls and no text."""
    parser = ToolCallParser(fmt, forced, tools)
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))  # (CallStart / deltas: in calls)
    return (content or None) if calls else content, calls
