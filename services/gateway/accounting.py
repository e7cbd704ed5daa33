"""Token accounting (pure functions): completion_tokens, finish_reason, cache stats, usage.

docs/architecture.md, "Token accounting": the worker that generated a token is the only authority
on how many it generated. Counts arrive as `generated_tokens` on the prefill's first-token reply
and on the decode's FINAL frame; the gateway sums them (saturating at 2**64 - 1, the wire type's range) and
clamps to max_tokens. Only when a worker's messages carried no count (a v1.0 worker) are that
worker's frames counted instead; with every worker old, that is "no frame carried a count -> count
frames", and in a half-upgraded pair (old prefill, new decode) each side is still counted once.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from shared.cluster import FinishReason

U64_MAX = 2**64 - 1


class Segment(enum.Enum):
    """The worker that generated part of a completion: the prefill worker's first token, or what
    the decode (or unified) worker generated."""

    PREFILL = "prefill"
    DECODE = "decode"


class FrameSource(enum.Enum):
    """Which worker message a relayed piece came from (for fallback counting)."""

    PREFILL_REPLY = "prefill_reply"
    DECODE_TOKENS = "decode_tokens"
    DECODE_FINAL = "decode_final"

    @property
    def segment(self) -> Segment:
        return Segment.PREFILL if self is FrameSource.PREFILL_REPLY else Segment.DECODE


def saturating_sum(counts: Iterable[int]) -> int:
    """Sum of non-negative counts that sticks at U64_MAX instead of overflowing the wire type."""
    total = 0
    for count in counts:
        total = saturating_add(total, count)
    return total


def saturating_add(total: int, count: int) -> int:
    """`total` (a saturating sum so far) plus one more count (for per-frame running sums)."""
    return min(U64_MAX, total + max(0, count))


def fallback_tokens(source: FrameSource, text: str, num_token_ids: int, stopped: bool) -> int:
    """Tokens a frame from a worker that sends no `generated_tokens` (v1.0) stands for.

    Token ids, when the worker returned them, are exact. Otherwise: a v1.0 decode worker sends one
    TOKENS frame per sampled token, even when its text is empty (byte fallback holds text back);
    the prefill reply stands for its one token unless it is an immediate EOS (no text, stopped);
    a FINAL frame stands for a token only when it carries that token's text.
    """
    if num_token_ids > 0:
        return num_token_ids
    if source is FrameSource.DECODE_TOKENS:
        return 1
    if source is FrameSource.PREFILL_REPLY:
        return 0 if (stopped and not text) else 1
    return 1 if text else 0


@dataclass(frozen=True)
class WorkerCount:
    """What one worker's messages say about the tokens it generated for a request."""

    reported: int | None  # its generated_tokens; None when the field was absent (never 0 for absent)
    frame_tokens: int = 0  # what its token-bearing frames stand for (fallback_tokens summed)

    @property
    def tokens(self) -> int:
        return self.frame_tokens if self.reported is None else max(0, self.reported)


def completion_tokens(counts: Iterable[WorkerCount], max_tokens: int) -> int:
    """usage.completion_tokens: each worker's authoritative count (or, only where it sent none,
    its frame count), summed with saturation and clamped to max_tokens."""
    return min(saturating_sum(c.tokens for c in counts), max(0, max_tokens))


def finish_reason(
    num_completion_tokens: int, max_tokens: int, worker_reason: FinishReason | None
) -> FinishReason:
    """The worker's own rule: abort stays abort; count >= max_tokens -> length; else the worker's
    stop reason (a worker that ended without naming one is treated as having stopped)."""
    if worker_reason is FinishReason.ABORT:
        return FinishReason.ABORT
    if num_completion_tokens >= max_tokens:
        return FinishReason.LENGTH
    return worker_reason if worker_reason is not None else FinishReason.STOP


@dataclass(frozen=True)
class CacheStats:
    """Prompt tokens served from a prefix cache instead of computed for this request (tokens):
    local = the serving worker's own hits when it prefilled; transferred = the prefill worker's
    hits in disaggregated serving (KV it computed and pushed is not cached)."""

    local_tokens: int = 0
    transferred_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.local_tokens + self.transferred_tokens


def cache_stats(prompt_tokens: int, local_tokens: int, transferred_tokens: int) -> CacheStats:
    """Clamp reported cache figures: each >= 0, and local + transferred <= prompt_tokens (local
    wins when the two overlap), so no derived figure can go negative or exceed the prompt."""
    prompt_tokens = max(0, prompt_tokens)
    local = min(max(0, local_tokens), prompt_tokens)
    transferred = min(max(0, transferred_tokens), prompt_tokens - local)
    return CacheStats(local, transferred)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cache: CacheStats

    @property
    def cached_tokens(self) -> int:
        return self.cache.cached_tokens

    @property
    def total_tokens(self) -> int:
        return min(U64_MAX, self.prompt_tokens + self.completion_tokens)
