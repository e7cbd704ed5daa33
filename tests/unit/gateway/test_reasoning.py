"""The reasoning parsers (deepseek_r1, qwen3): whole outputs split as vLLM's parsers of the same
names do, the same output fed in any fragments gives the same split with no tag text shown, and
the reasoning's token count from token ids (tags included, clamped to the authoritative count)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.reasoning import KINDS, Kind, Piece, ReasoningParser, reasoning_tokens, split

# (parser, output, reasoning, content, closed)
CASES: list[tuple[Kind, str, str | None, str, bool]] = [
    ("deepseek_r1", "<think>Let me see.</think>Paris.", "Let me see.", "Paris.", True),
    # the template opened <think> in the prompt
    ("deepseek_r1", "Let me see.</think>\n\nParis.", "Let me see.", "\n\nParis.", True),
    ("deepseek_r1", "Still thinking", "Still thinking", "", False),  # never closed: all reasoning
    ("deepseek_r1", "<think>cut short", "cut short", "", False),
    ("deepseek_r1", "</think>Paris.", "", "Paris.", True),
    ("deepseek_r1", "a</think>b</think><think>c", "a", "b</think><think>c", True),  # later tags are text
    ("deepseek_r1", "x <think> y</think>z", "x  y", "z", True),  # its own opening tag is dropped
    ("deepseek_r1", "a <thin k</think>", "a <thin k", "", True),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "\n\nParis.", True),
    ("qwen3", "Paris.", None, "Paris.", False),  # enable_thinking: false writes no tags
    ("qwen3", "Paris.</think>", None, "Paris.</think>", False),  # no <think>: no reasoning
    ("qwen3", "<think>cut short", "cut short", "", False),
    ("qwen3", "Hi <think>a</think> there", "a", "Hi  there", True),
    ("qwen3", "<think></think>x", "", "x", True),
    ("qwen3", "a <thin", None, "a <thin", False),  # a partial tag at the end is text
]


@pytest.mark.parametrize(("kind", "text", "reasoning", "content", "closed"), CASES)
def test_whole_outputs_split_like_vllm(
    kind: Kind, text: str, reasoning: str | None, content: str, closed: bool
) -> None:
    got = split(text, kind)
    assert (got.reasoning, got.content, got.closed) == (reasoning, content, closed)


def _streamed(kind: Kind, fragments: Sequence[str]) -> list[Piece]:
    parser = ReasoningParser(kind)
    pieces = [p for f in fragments for p in parser.feed(f)]
    return pieces + parser.finish()


@pytest.mark.parametrize(("kind", "text", "reasoning", "content", "closed"), CASES)
def test_one_character_at_a_time_gives_the_same_split(
    kind: Kind, text: str, reasoning: str | None, content: str, closed: bool
) -> None:
    pieces = _streamed(kind, list(text))
    assert "".join(p.text for p in pieces if p.reasoning) == (reasoning or "")
    assert "".join(p.text for p in pieces if not p.reasoning) == content


def test_a_tag_split_across_fragments_is_held_back_then_dropped() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.feed("<thi") == []  # could be <think>: nothing shown yet
    assert parser.feed("nk>Let") == [Piece(True, "Let")]
    assert parser.feed(" me</") == [Piece(True, " me")]
    assert parser.feed("think>Paris") == [Piece(False, "Paris")]
    assert parser.feed("</think>") == [Piece(False, "</think>")]  # after the reasoning: text
    assert parser.finish() == []
    held = ReasoningParser("deepseek_r1")
    assert held.feed("a <") == [Piece(True, "a ")]
    assert held.feed("b") == [Piece(True, "<b")]  # not a tag after all: shown at once
    assert held.feed("</th") == [] and held.finish() == [Piece(True, "</th")]


# outputs made of tags, tag fragments and text, so the tags land anywhere and split anywhere
_TEXT = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", ">", "a", " ", "\n", "🙂", "é"]),
    max_size=12,
).map("".join)


@given(text=_TEXT, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_any_chunking_gives_the_unary_split(text: str, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    fragments = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for kind in KINDS:
        whole = split(text, kind)
        pieces = _streamed(kind, fragments)
        assert "".join(p.text for p in pieces if p.reasoning) == (whole.reasoning or "")
        assert "".join(p.text for p in pieces if not p.reasoning) == whole.content
        assert all(p.text for p in pieces)  # no empty pieces
        # the reasoning span holds exactly the reasoning text plus the tags that were dropped
        start, end = whole.start, whole.end
        assert whole.content == text[:start] + text[end:] or whole.reasoning is None


# --- token counts: a toy tokenizer whose tokens are strings ---
VOCAB = ["<think>", "</think>", "Let", " me", " see", ".", "Paris", "\n", "</", "think", ">", "<|end|>"]


def _decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def _ids(*tokens: str) -> tuple[int, ...]:
    return tuple(VOCAB.index(t) for t in tokens)


@pytest.mark.parametrize(
    ("kind", "tokens", "want"),
    [
        # the tags' tokens count as reasoning; content and EOS after them do not
        ("deepseek_r1", ("<think>", "Let", " me", "</think>", "Paris", "<|end|>"), 4),
        ("deepseek_r1", ("Let", " me", "</think>", "\n", "Paris"), 3),  # <think> was in the prompt
        ("deepseek_r1", ("Let", " me", " see", "<|end|>"), 4),  # never closed: every token
        ("deepseek_r1", ("Let", "</", "think", ">", "Paris"), 4),  # a tag in three tokens
        ("qwen3", ("<think>", "Let", "</think>", "\n", "Paris"), 3),
        ("qwen3", ("Paris", ".", "<|end|>"), 0),
        ("qwen3", ("Paris", "<think>", "Let", "</think>", "."), 3),  # content before it is content
        ("qwen3", ("<think>", "Let", " me"), 3),
    ],
)
def test_reasoning_tokens_count_tokens_not_characters(kind: Kind, tokens: tuple[str, ...], want: int) -> None:
    ids = _ids(*tokens)
    assert reasoning_tokens(kind, ids, len(ids), _decode) == want


def test_reasoning_tokens_never_exceed_the_authoritative_count() -> None:
    ids = _ids("Let", " me", " see", ".", "</think>", "Paris")
    assert reasoning_tokens("deepseek_r1", ids, 3, _decode) == 3
    assert reasoning_tokens("deepseek_r1", ids, 0, _decode) == 0
    assert reasoning_tokens("deepseek_r1", (), 5, _decode) == 0
    unclosed = _ids("Let", " me")
    assert reasoning_tokens("deepseek_r1", unclosed, 2, _decode) == 2


@given(
    tokens=st.lists(st.sampled_from(VOCAB), max_size=40),
)
def test_reasoning_tokens_match_a_token_by_token_count(tokens: list[str]) -> None:
    """The prefix search agrees with counting the tokens one by one against the split."""
    ids = _ids(*tokens)
    for kind in KINDS:
        whole = split(_decode(ids), kind)
        want = 0
        if whole.reasoning is not None:
            at = 0
            for t in tokens:  # a token is reasoning when any of its characters is in the span
                if at + len(t) > whole.start and (at < whole.end or not whole.closed):
                    want += 1
                at += len(t)
        assert reasoning_tokens(kind, ids, len(ids), _decode) == want, (kind, tokens)
