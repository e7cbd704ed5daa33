"""The text syntax of two tool-call formats, read and written without the parser's streaming
state (tool_calls.py holds that): the pythonic call list of Llama 3.2 / 4
(`[get_weather(city="Paris"), get_time()]`, read with Python's own `ast`, never evaluated) and
Qwen3-Coder's XML call block (`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>
...</function>\\n</tool_call>`, its string values typed by the tool's JSON schema, as vLLM's
qwen3_coder parser does).

Every reader here answers from the text so far and never changes its answer when more text comes
(`NEED_MORE` until it can tell), so the streaming parser decides the same way in any
fragmentation."""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final, NoReturn

# --- pythonic ---

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's markers around calls
# the opening of a call list: "[", a function name and its "(" (what can still become one: _SO_FAR)
PYTHONIC_HEAD = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_]*\s*\(")
PYTHONIC_HEAD_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_][A-Za-z0-9_]*\s*)?")


class PythonListScanner:
    """Finds where a Python list that opens a text closes, fed the text as it grows: brackets
    counted outside strings (single, double and triple quoted, with escapes) and comments. The
    list's contents are judged later, by `ast`; this only says where it ends."""

    def __init__(self) -> None:
        self.pos = 0  # characters of the text scanned
        self._depth = 0
        self._quote = ""  # the open string's delimiter (' " ''' or \"\"\"), "" outside strings
        self._escaped = False
        self._comment = False

    def advance(self, text: str, final: bool) -> int | None:
        """The list's length once its closing bracket is in `text` (which holds what was given
        before, and more), else None. A quote at the end of the text waits for the next two
        characters (a triple quote?) unless `final`."""
        while self.pos < len(text):
            c = text[self.pos]
            if self._comment:
                self._comment = c != "\n"
            elif self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif text.startswith(self._quote, self.pos):
                    self.pos += len(self._quote) - 1
                    self._quote = ""
                elif len(self._quote) == 3 and c == self._quote[0] and len(text) - self.pos < 3 and not final:
                    return None  # may be the closing triple quote, cut
            elif c in "'\"":
                if len(text) - self.pos < 3 and not final:
                    return None  # one quote, or the start of a triple one: the next ones tell
                self._quote = c * 3 if text.startswith(c * 3, self.pos) else c
                self.pos += len(self._quote) - 1
            elif c == "#":
                self._comment = True
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self.pos += 1
                    return self.pos
            self.pos += 1
        return None


def pythonic_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """A Python list of calls -> [(name, arguments)], or None when `text` is not exactly one:
    each element a call of a plain name, keyword arguments only, each a literal (strings,
    numbers, True/False/None, lists, tuples, dicts with string keys) that JSON can hold. Read
    with `ast` (parse, then literal_eval of each argument's node): nothing is evaluated."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[tuple[str, dict[str, Any]]] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None  # (positional arguments: their names are unknown)
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **kwargs, or a name repeated
                return None
            try:
                value = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            if not _json_able(value):
                return None
            arguments[keyword.arg] = value
        calls.append((node.func.id, arguments))
    return calls


def _json_able(value: Any) -> bool:
    """Whether a literal is one JSON can write (no bytes, sets, complex, NaN or infinity)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_json_able(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_able(v) for k, v in value.items())
    return False


def python_literal(value: Any) -> str:
    """A JSON value written as the Python literal a pythonic call carries."""
    if value is None or isinstance(value, bool):
        return {None: "None", True: "True", False: "False"}[value]
    if isinstance(value, (str, int, float)):
        return json.dumps(value, ensure_ascii=False)  # (JSON's string escapes are Python's too)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def pythonic_text(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as one pythonic list: [name(key=literal, ...), ...]."""
    written = (
        f"{name}({', '.join(f'{k}={python_literal(v)}' for k, v in args.items())})" for name, args in calls
    )
    return "[" + ", ".join(written) + "]"


# --- Qwen3-Coder ---

QWEN_START, QWEN_END = "<tool_call>", "</tool_call>"
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
NEED_MORE: Final = "need more"  # the text so far cannot tell
_WS = " \t\r\n"


@dataclass(frozen=True)
class QwenCall:
    """A Qwen3-Coder call block read: the function, its parameters' raw text values (one newline
    after the opening tag and one before the closing tag removed) and the block's length."""

    name: str
    parameters: tuple[tuple[str, str], ...]
    end: int


class _Undecided(Exception):
    """The text so far cannot tell."""


class _NotACall(Exception):
    """No text that may follow makes this a call block."""


def qwen_call(text: str, final: bool) -> QwenCall | str | None:
    """The call block `text` opens with (it starts with `<tool_call>`): a QwenCall, None when it
    is not one, or NEED_MORE. A parameter's value ends at the first `</parameter>` followed (after
    whitespace) by the next `<parameter=` or `</function>` (so a value may hold that text too);
    the block ends after `</tool_call>`, or after `</function>` when other text follows (when
    `final`, a cut `</tool_call>` too). A block without its `</function>` is none."""
    try:
        return _QwenReader(text, final).call()
    except _Undecided:
        return NEED_MORE
    except _NotACall:
        return None


@dataclass
class _QwenReader:
    text: str
    final: bool
    at: int = 0

    def call(self) -> QwenCall:
        self.at = len(QWEN_START)
        self._expect(_FUNCTION)
        name = self._name()
        parameters: list[tuple[str, str]] = []
        while not self._next_is(_FUNCTION_END, _PARAMETER):
            param = self._name()
            end = self._value_end()
            value = self.text[self.at : end]
            value = value[1:] if value.startswith("\n") else value
            parameters.append((param, value[:-1] if value.endswith("\n") else value))
            self.at = end + len(_PARAMETER_END)
        closed = self.at + len(_FUNCTION_END)
        after = self._skip_ws(closed)
        if self.text.startswith(QWEN_END, after):
            return QwenCall(name, tuple(parameters), after + len(QWEN_END))
        if QWEN_END.startswith(self.text[after:]):  # (nothing yet, or a cut </tool_call>)
            if not self.final:
                raise _Undecided
            return QwenCall(name, tuple(parameters), len(self.text))
        return QwenCall(name, tuple(parameters), closed)

    def _undecided(self) -> NoReturn:
        """More text may tell (at the end of the output, none comes: not a call)."""
        if not self.final:
            raise _Undecided
        raise _NotACall

    def _skip_ws(self, at: int) -> int:
        while at < len(self.text) and self.text[at] in _WS:
            at += 1
        return at

    def _expect(self, tag: str) -> None:
        """Past whitespace, `tag`: step past it."""
        self.at = self._skip_ws(self.at)
        if self.text.startswith(tag, self.at):
            self.at += len(tag)
            return
        if tag.startswith(self.text[self.at :]):
            self._undecided()
        raise _NotACall

    def _next_is(self, ends: str, opens: str) -> bool:
        """Past whitespace: True at `ends` (left there), False past `opens`, else not a call."""
        self.at = self._skip_ws(self.at)
        rest = self.text[self.at :]
        if rest.startswith(ends):
            return True
        if rest.startswith(opens):
            self.at += len(opens)
            return False
        if ends.startswith(rest) or opens.startswith(rest):
            self._undecided()
        raise _NotACall

    def _name(self) -> str:
        """The name up to a tag's `>`, and past it: no line break or `<` in it, 1-256 chars."""
        end = self.text.find(">", self.at)
        name = self.text[self.at :] if end < 0 else self.text[self.at : end]
        if (end >= 0 and not name) or len(name) > 256 or any(c in name for c in "<\n"):
            raise _NotACall
        if end < 0:
            self._undecided()
        self.at = end + 1
        return name

    def _value_end(self) -> int:
        """Where the parameter value starting here ends: its `</parameter>`."""
        search = self.at
        while True:
            end = self.text.find(_PARAMETER_END, search)
            if end < 0:
                self._undecided()
            rest = self.text[self._skip_ws(end + len(_PARAMETER_END)) :]
            if rest.startswith(_PARAMETER) or rest.startswith(_FUNCTION_END):
                return end
            if _PARAMETER.startswith(rest) or _FUNCTION_END.startswith(rest):
                self._undecided()
            search = end + len(_PARAMETER_END)


def qwen_text(name: str, arguments: dict[str, Any]) -> str:
    """A call written as Qwen3-Coder writes it (strings as they are, other values as JSON)."""
    values = {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in arguments.items()}
    params = "".join(f"{_PARAMETER}{k}>\n{v}\n{_PARAMETER_END}\n" for k, v in values.items())
    return f"{QWEN_START}\n{_FUNCTION}{name}>\n{params}{_FUNCTION_END}\n{QWEN_END}"


def typed_value(raw: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its JSON schema's type (vLLM's rules): integer, number,
    boolean, object and array parsed as JSON (object / array also as a Python literal), null or
    None as null where the schema allows null or the type is not a string; anything that does
    not parse, a string type, or no known type: the text itself."""
    kinds = _schema_types(schema)
    main = next((k for k in kinds if k != "null"), "string")
    text = raw.strip()
    if text.lower() in ("null", "none") and ("null" in kinds or main != "string"):
        return None
    if main in ("integer", "number"):
        number = _json_or_none(text)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            return raw
        if main == "integer" and isinstance(number, float):
            return int(number) if number.is_integer() else raw
        return number
    if main == "boolean":
        return {"true": True, "false": False}.get(text.lower(), raw)
    if main in ("object", "array"):
        kind = dict if main == "object" else list
        value = _json_or_none(text)
        if not isinstance(value, kind):
            try:  # a Python literal ({'k': 'v'}), as some models write
                value = ast.literal_eval(text)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return raw
            if isinstance(value, tuple) and main == "array":
                value = list(value)
        return value if isinstance(value, kind) and _json_able(value) else raw
    return raw


def _schema_types(schema: Any) -> list[str]:
    """The types a property's schema names: its `type` (a name or a list), else those of its
    anyOf / oneOf members, in order."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind.lower()]
    if isinstance(kind, list):
        return [k.lower() for k in kind if isinstance(k, str)]
    found: list[str] = []
    for member in (schema.get("anyOf") or []) + (schema.get("oneOf") or []):
        found.extend(_schema_types(member))
    return found


def _json_or_none(text: str) -> Any:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
