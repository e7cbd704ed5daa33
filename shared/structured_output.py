"""Structured outputs: what a request's output must match (a JSON schema, any JSON object, a
regex, one of a list of strings, a context-free grammar in GBNF or Lark syntax) and its
llguidance grammar. The gateway validates with it (no
tokenizer needed); the workers build their token masks from the same grammar text.

llguidance was chosen over xgrammar by measurement (SmolLM2's tokenizer, a 4-property JSON
schema, one thread, AVX-512): xgrammar 2.7 us median per token mask, llguidance 15.7 us; both are
well under 0.1 % of a ~50 ms decode step, and llguidance has no dependencies while xgrammar pulls
triton and apache-tvm-ffi."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: `spec` is the JSON schema (JSON text), the regex or the grammar (GBNF, as
    llama.cpp and vLLM's guided_grammar write it, or Lark, as llguidance reads it); `choices` the
    strings of a choice; json_object needs neither."""

    kind: Kind
    spec: str = ""
    choices: tuple[str, ...] = ()


def from_fields(
    json_schema: str = "",
    json_object: bool = False,
    regex: str = "",
    choice: tuple[str, ...] = (),
    grammar: str = "",
) -> StructuredOutput | None:
    """The constraint a StructuredOutput message (or equivalent fields) sets; None when none is
    set. Raises InvalidStructuredOutput when more than one is."""
    given = [
        name
        for name, v in (
            ("json_schema", json_schema),
            ("json_object", json_object),
            ("regex", regex),
            ("choice", choice),
            ("grammar", grammar),
        )
        if v
    ]
    if len(given) > 1:
        raise InvalidStructuredOutput(f"set exactly one of {', '.join(KINDS)}; got {' and '.join(given)}")
    if not given:
        return None
    if json_schema:
        return StructuredOutput("json_schema", json_schema)
    if json_object:
        return StructuredOutput("json_object")
    if regex:
        return StructuredOutput("regex", regex)
    if grammar:
        return StructuredOutput("grammar", grammar)
    return StructuredOutput("choice", choices=tuple(choice))


class InvalidStructuredOutput(ValueError):
    """The constraint cannot be compiled (the message says why)."""


@functools.lru_cache(maxsize=256)
def grammar_of(s: StructuredOutput) -> str:
    """The llguidance grammar text of a constraint (cached per constraint). Raises
    InvalidStructuredOutput."""
    import llguidance

    # JSON as json.dumps writes it (", " and ": ", no other whitespace): with free whitespace a
    # model can pad forever (random weights do, and real models sometimes)
    compact: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
    if s.kind == "json_object":
        grammar = str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact))
    elif s.kind == "json_schema":
        try:
            schema = json.loads(s.spec)
        except json.JSONDecodeError as exc:
            raise InvalidStructuredOutput(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidStructuredOutput("the JSON schema must be a JSON object")
        try:
            grammar = str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact))
        except (ValueError, TypeError) as exc:
            raise InvalidStructuredOutput(f"the JSON schema cannot be used: {exc}") from None
    elif s.kind == "regex":
        if not s.spec:
            raise InvalidStructuredOutput("the regex is empty")
        grammar = str(llguidance.LLMatcher.grammar_from_regex(s.spec))
    elif s.kind == "choice":
        if not s.choices or any(not c for c in s.choices):
            raise InvalidStructuredOutput("choice needs at least one non-empty string")
        # lark string literals take JSON's escapes
        grammar = str(
            llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in s.choices))
        )
    elif s.kind == "grammar":
        grammar = _grammar_text(s.spec)
    else:
        raise InvalidStructuredOutput(f"unknown kind {s.kind!r}; use one of {', '.join(KINDS)}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidStructuredOutput(error.strip())
    return grammar


def _grammar_text(text: str) -> str:
    """A GBNF or Lark grammar as llguidance's grammar text (llguidance tells the two apart and
    converts GBNF: rules `name ::= ...` with `root` as the start, the syntax of llama.cpp and of
    vLLM's guided_grammar examples; Lark starts at `start`)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if not text.strip():
        raise InvalidStructuredOutput("the grammar is empty")
    try:
        return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(text)))
    except Exception as exc:  # llguidance raises plain Exception (and GbnfToLarkError) with the reason
        raise InvalidStructuredOutput(f"the grammar cannot be used: {exc}") from None
