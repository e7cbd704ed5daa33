"""Token accounting: sums, saturation, clamping, fallback counting, finish_reason, cache stats."""

from __future__ import annotations

import pytest

from services.gateway.accounting import (
    U64_MAX,
    CacheStats,
    FrameSource,
    Usage,
    WorkerCount,
    cache_stats,
    completion_tokens,
    fallback_tokens,
    finish_reason,
    saturating_sum,
)
from shared.cluster import FinishReason


def test_saturating_sum_adds_small_counts() -> None:
    assert saturating_sum([1, 5, 0]) == 6
    assert saturating_sum([]) == 0


def test_saturating_sum_sticks_at_u64_max() -> None:
    assert saturating_sum([U64_MAX, 1]) == U64_MAX
    assert saturating_sum([U64_MAX - 1, U64_MAX, U64_MAX]) == U64_MAX


def test_saturating_sum_ignores_negative_garbage() -> None:
    assert saturating_sum([3, -10]) == 3


def test_completion_tokens_is_sum_of_authoritative_counts() -> None:
    # prefill's first token (1) + decode's post-handoff count (9); frames do not matter
    counts = [WorkerCount(1, frame_tokens=1), WorkerCount(9, frame_tokens=3)]
    assert completion_tokens(counts, max_tokens=100) == 10


def test_completion_tokens_prefers_counts_even_when_frames_disagree() -> None:
    # byte fallback: 5 tokens made 1 text piece; counts win over frames
    assert completion_tokens([WorkerCount(1, 1), WorkerCount(4, 1)], max_tokens=100) == 5


def test_completion_tokens_zero_count_is_a_count() -> None:
    # an immediate EOS reports 0: present, not absent; the frame fallback must not kick in
    assert completion_tokens([WorkerCount(0, frame_tokens=1)], max_tokens=16) == 0


def test_inflated_count_is_clamped_to_max_tokens() -> None:
    assert completion_tokens([WorkerCount(1), WorkerCount(10_000)], max_tokens=8) == 8
    assert completion_tokens([WorkerCount(U64_MAX), WorkerCount(U64_MAX)], max_tokens=8) == 8


def test_fallback_counting_when_no_frame_carried_a_count() -> None:
    assert completion_tokens([WorkerCount(None, 1), WorkerCount(None, 2)], max_tokens=100) == 3


def test_fallback_counting_is_clamped() -> None:
    assert completion_tokens([WorkerCount(None, 50)], max_tokens=7) == 7


def test_half_upgraded_pair_counts_each_worker_once() -> None:
    # an old prefill worker (no count: its reply frame stands for 1) + a new decode worker (count 6)
    assert completion_tokens([WorkerCount(None, 1), WorkerCount(6, 2)], max_tokens=100) == 7


@pytest.mark.parametrize(
    ("source", "text", "ids", "stopped", "expected"),
    [
        (FrameSource.DECODE_TOKENS, "", 0, False, 1),  # byte fallback: empty text, one token
        (FrameSource.DECODE_TOKENS, "ab", 0, False, 1),
        (FrameSource.DECODE_TOKENS, "", 3, False, 3),  # token ids are exact
        (FrameSource.PREFILL_REPLY, "Hi", 0, False, 1),
        (FrameSource.PREFILL_REPLY, "", 0, False, 1),  # partial character held back
        (FrameSource.PREFILL_REPLY, "", 0, True, 0),  # immediate EOS
        (FrameSource.DECODE_FINAL, "", 0, True, 0),
        (FrameSource.DECODE_FINAL, "x", 0, True, 1),
        (FrameSource.DECODE_FINAL, "", 2, True, 2),
    ],
)
def test_fallback_tokens_per_frame(
    source: FrameSource, text: str, ids: int, stopped: bool, expected: int
) -> None:
    assert fallback_tokens(source, text, ids, stopped) == expected


@pytest.mark.parametrize(
    ("count", "max_tokens", "worker", "expected"),
    [
        (5, 5, FinishReason.STOP, FinishReason.LENGTH),  # the worker's rule: count >= max -> length
        (5, 5, FinishReason.LENGTH, FinishReason.LENGTH),
        (4, 5, FinishReason.STOP, FinishReason.STOP),
        (4, 5, FinishReason.LENGTH, FinishReason.LENGTH),  # e.g. the model's length limit
        (5, 5, FinishReason.ABORT, FinishReason.ABORT),  # abort stays abort
        (0, 5, FinishReason.ABORT, FinishReason.ABORT),
        (0, 5, None, FinishReason.STOP),
        (7, 5, None, FinishReason.LENGTH),
    ],
)
def test_finish_reason_rule(
    count: int, max_tokens: int, worker: FinishReason | None, expected: FinishReason
) -> None:
    assert finish_reason(count, max_tokens, worker) is expected


def test_cache_stats_sum_and_split() -> None:
    stats = cache_stats(100, 32, 48)
    assert stats == CacheStats(32, 48)
    assert stats.cached_tokens == 80


def test_cache_stats_never_exceed_prompt_and_never_negative() -> None:
    assert cache_stats(10, 8, 8) == CacheStats(8, 2)
    assert cache_stats(10, 50, 0) == CacheStats(10, 0)
    assert cache_stats(10, -3, -1) == CacheStats(0, 0)
    assert cache_stats(0, 5, 5).cached_tokens == 0


def test_usage_total() -> None:
    usage = Usage(prompt_tokens=12, completion_tokens=5, cache=CacheStats(4, 0))
    assert usage.total_tokens == 17
    assert usage.cached_tokens == 4
