"""Request status life (the allowed-transition table) and the one finish rule, on requests with no
handle and no text."""

from __future__ import annotations

import pytest

from services.worker.engine.api import EngineRequest, FinishReason, RequestKind, SamplingConfig
from services.worker.engine.request import (
    ALLOWED_TRANSITIONS,
    InvalidTransition,
    Request,
    RequestStatus,
    finish_rule,
)

EOS = frozenset({2})


def make(max_tokens: int = 4, kind: RequestKind = RequestKind.FULL, **sampling: object) -> Request:
    sp = SamplingConfig(max_tokens=max_tokens, temperature=0.0, **sampling)  # type: ignore[arg-type]
    return Request.from_engine_request(EngineRequest("r", (5, 6, 7), sp, kind=kind))


def test_every_status_has_a_row_and_finished_is_final() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(RequestStatus)
    assert ALLOWED_TRANSITIONS[RequestStatus.FINISHED] == frozenset()
    assert all(
        RequestStatus.FINISHED in to
        for s, to in ALLOWED_TRANSITIONS.items()
        if s is not RequestStatus.FINISHED
    )
    assert [s.is_finished for s in RequestStatus] == [False] * 5 + [True]


def test_full_request_life() -> None:
    req = make()
    assert req.status is RequestStatus.WAITING
    req.mark_running()
    req.spec_token_ids = [1, 2]
    req.preempt()
    assert req.status is RequestStatus.PREEMPTED and req.spec_token_ids == []
    req.mark_running()
    req.finish(FinishReason.STOP)
    assert (req.status, req.finish_reason) == (RequestStatus.FINISHED, FinishReason.STOP)
    with pytest.raises(InvalidTransition):
        req.mark_running()
    with pytest.raises(InvalidTransition):
        req.finish(FinishReason.ABORT)


def test_remote_and_held_lives() -> None:
    remote = make(kind=RequestKind.DECODE_REMOTE)
    assert remote.status is RequestStatus.WAITING_FOR_KV
    with pytest.raises(InvalidTransition):
        remote.mark_running()  # not before its KV arrived
    remote.kv_arrived()
    remote.mark_running()
    held = make(kind=RequestKind.PREFILL_ONLY)
    with pytest.raises(InvalidTransition):
        held.hold(None)  # only a running request is held
    held.mark_running()
    held.hold(None)
    with pytest.raises(InvalidTransition):
        held.finish(FinishReason.STOP)  # a held request ends through release
    held.release()
    assert held.status is RequestStatus.FINISHED and held.finish_reason is None
    with pytest.raises(InvalidTransition):
        held.release()


def test_finish_rule_puts_max_tokens_above_the_stop() -> None:
    assert finish_rule(3, 4, None) is None
    assert finish_rule(3, 4, FinishReason.STOP) is FinishReason.STOP
    assert finish_rule(4, 4, FinishReason.STOP) is FinishReason.LENGTH
    assert finish_rule(4, 4, None) is FinishReason.LENGTH
    assert finish_rule(0, 1, FinishReason.STOP) is FinishReason.STOP  # immediate EOS: count 0


def test_eos_is_neither_appended_nor_counted() -> None:
    req = make(max_tokens=4)
    assert req.append_output_token(9, EOS, 100) is None
    assert req.append_output_token(2, EOS, 100) is FinishReason.STOP
    assert req.token_ids[3:] == [9] and req.num_generated_tokens == 1
    ignoring = make(max_tokens=2, ignore_eos=True)
    assert ignoring.append_output_token(2, EOS, 100) is None
    assert ignoring.append_output_token(2, EOS, 100) is FinishReason.LENGTH


def test_stop_token_is_counted_and_length_wins_at_max_tokens() -> None:
    req = make(max_tokens=2, stop_token_ids=(8,))
    assert req.append_output_token(8, EOS, 100) is FinishReason.STOP
    assert req.num_generated_tokens == 1
    at_max = make(max_tokens=1, stop_token_ids=(8,))
    assert at_max.append_output_token(8, EOS, 100) is FinishReason.LENGTH


def test_full_context_is_length() -> None:
    req = make(max_tokens=10)
    assert req.append_output_token(9, EOS, 5) is None  # 4 tokens of 5
    assert req.append_output_token(9, EOS, 5) is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("run", "max_tokens", "consumed", "reason", "appended"),
    [
        ([9, 9, 9], 10, 3, None, 3),
        ([9, 9, 9, 9], 2, 2, FinishReason.LENGTH, 2),  # max_tokens inside the run
        ([9, 2, 9], 10, 2, FinishReason.STOP, 1),  # EOS inside the run: not appended
        ([9, 8, 9], 10, 2, FinishReason.STOP, 2),  # a stop token inside the run: appended
        ([9, 2, 9], 1, 1, FinishReason.LENGTH, 1),
    ],
)
def test_a_run_ends_exactly_where_one_token_at_a_time_would(
    run: list[int], max_tokens: int, consumed: int, reason: FinishReason | None, appended: int
) -> None:
    req = make(max_tokens=max_tokens, stop_token_ids=(8,))
    assert req.append_output_tokens(run, EOS, 100) == (consumed, reason)
    assert req.num_output_tokens == appended
    one = make(max_tokens=max_tokens, stop_token_ids=(8,))
    for t in run:
        last = one.append_output_token(t, EOS, 100)
        if last is not None:
            break
    assert one.token_ids == req.token_ids


def test_draw_seed_follows_the_output_index() -> None:
    import torch

    sp = SamplingConfig(max_tokens=4, temperature=1.0, seed=7)
    req = Request.from_engine_request(EngineRequest("r", (5, 6), sp), generator=torch.Generator())
    seeds = [req.draw_seed(j) for j in range(3)]
    assert len(set(seeds)) == 3
    req.append_output_token(9, EOS, 100)
    assert req.draw_seed(0) == seeds[1] and req.draw_seed(1) == seeds[2]
    unseeded = make()
    assert unseeded.draw_seed(0) is None
