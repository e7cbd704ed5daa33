"""RequestState: status transitions, derived counts, cache stats set once."""

from __future__ import annotations

import pytest

from services.gateway.accounting import FrameSource
from services.gateway.request import ALLOWED_TRANSITIONS, InvalidTransition, RequestState, RequestStatus
from shared.cluster import FinishReason


def make_state(prompt_len: int = 10, max_tokens: int = 5) -> RequestState:
    state = RequestState("r1", tuple(range(prompt_len)), return_token_ids=True, model="m")
    state.mark_scheduled(max_tokens)
    return state


def test_finished_statuses_are_terminal() -> None:
    for status in RequestStatus:
        if status.is_finished:
            assert ALLOWED_TRANSITIONS[status] == frozenset()
    assert RequestStatus.FAILED.is_finished
    assert not RequestStatus.DECODING.is_finished


def test_disaggregated_life() -> None:
    state = make_state()
    state.advance(RequestStatus.ADMITTED)
    state.advance(RequestStatus.PREFILLING)
    state.record_output(FrameSource.PREFILL_REPLY, "Hel", (7,), 1, None)
    state.advance(RequestStatus.DECODING)
    state.note_frame_sent()
    state.record_output(FrameSource.DECODE_TOKENS, "lo", (8,), None, None)
    state.record_output(FrameSource.DECODE_FINAL, "", (), 2, FinishReason.STOP)
    state.finish()
    assert state.status is RequestStatus.FINISHED_STOPPED
    assert state.text == "Hello"
    assert state.output_token_ids == (7, 8)
    assert state.num_completion_tokens == 3
    assert state.finish_reason is FinishReason.STOP


def test_invalid_transitions_raise() -> None:
    state = make_state()
    with pytest.raises(InvalidTransition):
        state.advance(RequestStatus.DECODING)  # not before prefill
    state.advance(RequestStatus.PREFILLING)
    state.advance(RequestStatus.DECODING)
    with pytest.raises(InvalidTransition):
        state.advance(RequestStatus.PREFILLING)


def test_retry_only_before_handoff() -> None:
    state = make_state()
    state.advance(RequestStatus.ADMITTED)
    state.record_cache(16, 0)
    state.reset_for_retry()
    assert state.status is RequestStatus.WAITING
    assert state.cache.cached_tokens == 0
    state.mark_scheduled(5)
    assert state.attempts == 2
    state.advance(RequestStatus.PREFILLING)
    state.note_frame_sent()
    with pytest.raises(InvalidTransition):
        state.reset_for_retry()


def test_count_reaching_max_tokens_is_length() -> None:
    state = make_state(max_tokens=3)
    state.advance(RequestStatus.PREFILLING)
    state.record_output(FrameSource.PREFILL_REPLY, "a", (), 1, None)
    state.record_output(FrameSource.DECODE_FINAL, "", (), 2, FinishReason.STOP)
    state.finish()
    assert state.finish_reason is FinishReason.LENGTH
    assert state.status is RequestStatus.FINISHED_LENGTH


def test_inflated_worker_count_clamped() -> None:
    state = make_state(max_tokens=4)
    state.record_output(FrameSource.DECODE_FINAL, "x", (), 1_000_000, FinishReason.STOP)
    assert state.usage.completion_tokens == 4
    assert state.usage.total_tokens == 14


def test_fallback_when_no_counts() -> None:
    state = make_state(max_tokens=10)
    state.record_output(FrameSource.PREFILL_REPLY, "a", (), None, None)
    for _ in range(3):  # byte fallback: empty text pieces, one token each
        state.record_output(FrameSource.DECODE_TOKENS, "", (), None, None)
    state.record_output(FrameSource.DECODE_FINAL, "", (), None, FinishReason.STOP)
    assert not state.has_reported_counts
    assert state.num_completion_tokens == 4
    assert state.finish_reason is FinishReason.STOP


def test_cache_stats_set_once() -> None:
    state = make_state(prompt_len=40)
    state.record_cache(16, 0)
    assert state.cache.cached_tokens == 16  # read between frames: still follows what comes next
    state.record_cache(32, 24)  # a later frame (e.g. after preemption) cannot rewrite local
    state.record_cache(0, 8)
    assert state.cache.local_tokens == 16
    assert state.cache.transferred_tokens == 24
    assert state.usage.cached_tokens == 40


def test_cache_never_exceeds_prompt() -> None:
    state = make_state(prompt_len=10)
    state.record_cache(8, 8)
    assert state.cache.cached_tokens == 10


def test_abort_override() -> None:
    state = make_state()
    state.advance(RequestStatus.PREFILLING)
    state.finish(FinishReason.ABORT)
    assert state.status is RequestStatus.FINISHED_ABORTED
    assert state.finish_reason is FinishReason.ABORT


def test_latencies_derived_from_frame_times() -> None:
    state = RequestState("r", (1,), False, "m", arrival_s=100.0)
    state.note_frame_sent(100.5)
    state.note_frame_sent(100.75)
    state.note_frame_sent(101.0)
    assert state.ttft_s == 0.5
    assert state.inter_frame_s == [0.25, 0.25]


class _Clock:
    """time.monotonic for services.gateway.request, set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ttft_phases_add_up_to_the_ttft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Disaggregated: schedule, the decode worker's admission, then prefill (prompt + KV handoff)
    until the first frame; a migration after the first frame changes none of them."""
    clock = _Clock(100.0)
    monkeypatch.setattr("services.gateway.request.time.monotonic", clock)
    state = RequestState("r", (1, 2), True, "m", arrival_s=100.0)
    assert state.ttft_phases_s == {}
    for at, step in (
        (100.010, lambda: state.mark_scheduled(5)),
        (100.030, lambda: state.advance(RequestStatus.ADMITTED)),
        (100.031, lambda: state.advance(RequestStatus.PREFILLING)),
        (100.200, lambda: state.advance(RequestStatus.DECODING)),
    ):
        clock.now = at
        step()
    state.note_frame_sent(100.200)
    want = {"schedule": 0.010, "admit": 0.020, "prefill": 0.170}
    assert state.ttft_phases_s == pytest.approx(want)
    assert sum(state.ttft_phases_s.values()) == pytest.approx(state.ttft_s)
    clock.now = 101.0  # the decode worker died: the request moves on, its first frame long sent
    state.advance(RequestStatus.WAITING)
    state.mark_scheduled(5)
    assert state.ttft_phases_s == pytest.approx(want)


def test_ttft_phases_are_the_answering_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry before any frame: `schedule` runs to the attempt that answered (the failed one
    included), and a unified answer has no `admit` (the failed attempt's is dropped)."""
    clock = _Clock(50.0)
    monkeypatch.setattr("services.gateway.request.time.monotonic", clock)
    state = RequestState("r", (1,), True, "m", arrival_s=50.0)
    for at, step in (
        (50.01, lambda: state.mark_scheduled(5)),
        (50.02, lambda: state.advance(RequestStatus.ADMITTED)),
        (50.05, state.reset_for_retry),
        (50.06, lambda: state.mark_scheduled(5)),
        (50.061, lambda: state.advance(RequestStatus.PREFILLING)),
    ):
        clock.now = at
        step()
    state.note_frame_sent(50.1)
    assert state.ttft_phases_s == pytest.approx({"schedule": 0.06, "prefill": 0.04})


def test_half_upgraded_pair_old_prefill_new_decode() -> None:
    state = make_state(max_tokens=10)
    state.record_output(FrameSource.PREFILL_REPLY, "a", (), None, None)  # v1.0 prefill worker
    state.record_output(FrameSource.DECODE_TOKENS, "b", (), None, None)
    state.record_output(FrameSource.DECODE_FINAL, "", (), 4, FinishReason.STOP)  # new decode worker
    assert state.num_completion_tokens == 5


def test_half_upgraded_pair_new_prefill_old_decode() -> None:
    state = make_state(max_tokens=10)
    state.record_output(FrameSource.PREFILL_REPLY, "a", (), 1, None)
    for _ in range(3):
        state.record_output(FrameSource.DECODE_TOKENS, "", (), None, None)
    state.record_output(FrameSource.DECODE_FINAL, "", (), None, FinishReason.STOP)
    assert state.num_completion_tokens == 4
