"""Reasoning models' output (`<think> ... </think> answer`, `--reasoning-parser`): the incremental
parser that splits a chat output into reasoning and content, fed in any fragments (so a stream's
deltas always reassemble to the unary split), and the number of generated tokens the reasoning
took. Pure: no grpc, no tokenizer (decoding is passed in).

The two parsers follow vLLM's of the same names:
- `deepseek_r1`: the chat template may already have opened `<think>` in the prompt, so the output
  is reasoning from its first character up to the first `</think>`; a `<think>` the model writes
  itself before that is dropped; with no `</think>` at all, everything is reasoning.
- `qwen3`: reasoning only once the model writes `<think>` (Qwen3 with `enable_thinking: false`
  writes no tags: everything is content); it runs to the next `</think>`, or to the end. Text
  before `<think>` is content.
After the reasoning everything is content: a later tag is just text. The tags themselves are in
neither part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

Kind = Literal["deepseek_r1", "qwen3"]
KINDS: tuple[Kind, ...] = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


class Piece(NamedTuple):
    """A run of output text and which part it belongs to."""

    reasoning: bool
    text: str


class Split(NamedTuple):
    """A whole output: `reasoning` is None when it had no reasoning section (qwen3 without
    `<think>`); `start` / `end` are where the section, tags included, lies in the output
    (characters; `end` = len(output) when it never closed)."""

    reasoning: str | None
    content: str
    start: int
    end: int
    closed: bool


class ReasoningParser:
    """Splits one output into reasoning and content pieces, fed in any fragments.

    `feed(text)` and `finish()` return the pieces that are certain so far, in output order;
    text that may be the beginning of a tag the parser is looking for is held back until the
    next fragment tells (at most len(tag) - 1 characters), so a tag split across tokens or
    frames is still found and never shown. Invariant: the texts of all pieces (of each part)
    concatenate to the same strings however the output is cut into fragments.
    """

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        # deepseek_r1 is inside the reasoning from the start; qwen3 waits for <think>
        self.started = kind == "deepseek_r1"
        self.ended = False
        self._may_open = kind == "deepseek_r1"  # deepseek_r1: a <think> before </think> is dropped
        self._buf = ""  # text not yet decided (a possible partial tag)
        self._content_before = 0  # qwen3: characters of content before <think>
        self._consumed = 0  # characters of output fed and decided so far (tags included)
        self._end = 0  # once ended: where the reasoning ended (after </think>)

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        self._scan(out, final=False)
        return out

    def finish(self) -> list[Piece]:
        """The rest, once the output is complete (a partial tag at the end is text)."""
        out: list[Piece] = []
        self._scan(out, final=True)
        return out

    def _emit(self, out: list[Piece], reasoning: bool, text: str) -> None:
        self._consumed += len(text)
        if not text:
            return
        if not reasoning and not self.started:
            self._content_before += len(text)
        if out and out[-1].reasoning == reasoning:
            out[-1] = Piece(reasoning, out[-1].text + text)
        else:
            out.append(Piece(reasoning, text))

    def _tags(self) -> tuple[str, ...]:
        """The tags that would change the state now."""
        if not self.started:
            return (THINK_START,)
        return (THINK_END, THINK_START) if self._may_open else (THINK_END,)

    def _scan(self, out: list[Piece], final: bool) -> None:
        while self._buf:
            if self.ended:  # content to the end
                self._emit(out, False, self._buf)
                self._buf = ""
                return
            tags = self._tags()
            at, tag = _first(self._buf, tags)
            if tag is None:
                keep = 0 if final else max(_partial_suffix(self._buf, t) for t in tags)
                self._emit(out, self.started, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return
            self._emit(out, self.started, self._buf[:at])
            self._buf = self._buf[at + len(tag) :]
            self._consumed += len(tag)
            if tag == THINK_START and self.started:  # deepseek_r1's own opening tag: dropped
                self._may_open = False
            elif tag == THINK_START:
                self.started = True
            else:
                self.ended = True
                self._end = self._consumed

    @property
    def reasoning_span(self) -> tuple[int, int]:
        """Where the reasoning lies in the output fed so far, tags included (characters):
        from `<think>` (0 for deepseek_r1) to the end of `</think>`, or to the end while open."""
        return self._content_before, self._end if self.ended else self._consumed + len(self._buf)


def _first(text: str, tags: Sequence[str]) -> tuple[int, str | None]:
    """The earliest of `tags` in `text` (position, tag), or (-1, None)."""
    best: tuple[int, str | None] = (-1, None)
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best[1] is None or at < best[0]):
            best = (at, tag)
    return best


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(text: str, kind: Kind) -> Split:
    """A whole output -> its reasoning and content (the streamed pieces, joined)."""
    parser = ReasoningParser(kind)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(p.text for p in pieces if p.reasoning)
    content = "".join(p.text for p in pieces if not p.reasoning)
    start, end = parser.reasoning_span
    return Split(reasoning if parser.started else None, content, start, end, parser.ended)


Decode = Callable[[tuple[int, ...]], str]  # token ids -> their text, special tokens kept


def reasoning_tokens(kind: Kind, token_ids: tuple[int, ...], completion_tokens: int, decode: Decode) -> int:
    """How many of the generated tokens were reasoning, tags included (as vLLM and OpenAI count
    them): the tokens from the one that starts `<think>` (the first, for deepseek_r1) through the
    one that ends `</think>`, or through the last generated token when the reasoning never closed
    (an EOS after it too). Tokens, not characters: the section is found in the text of the ids
    (`decode`, special tokens kept) and mapped to tokens by the lengths of decoded prefixes, which
    grow with k except around a character cut between tokens; so a token that holds both a tag's
    end and content counts as reasoning. At most `completion_tokens` (the authoritative count)."""
    if not token_ids or completion_tokens <= 0:
        return 0
    found = split(decode(token_ids), kind)
    if found.reasoning is None:
        return 0
    first = 0 if found.start == 0 else _tokens_within(token_ids, decode, found.start)
    last = _tokens_to_cover(token_ids, decode, found.end) if found.closed else completion_tokens
    return max(0, min(last, completion_tokens) - first)


def _tokens_to_cover(ids: tuple[int, ...], decode: Decode, chars: int) -> int:
    """The fewest leading tokens whose text is at least `chars` long (galloping, then halving:
    the reasoning usually ends early in a long output, so only its own length is decoded)."""
    if chars <= 0:
        return 0
    hi = 1
    while hi < len(ids) and len(decode(ids[:hi])) < chars:
        hi *= 2
    hi = min(hi, len(ids))
    lo = hi // 2  # len(decode(ids[:lo])) < chars (or lo == 0)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= chars:
            hi = mid
        else:
            lo = mid
    return hi


def _tokens_within(ids: tuple[int, ...], decode: Decode, chars: int) -> int:
    """The most leading tokens whose text is at most `chars` long."""
    return _tokens_to_cover(ids, decode, chars + 1) - 1 if len(decode(ids)) > chars else len(ids)
