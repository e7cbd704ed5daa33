"""A decode worker that leaves membership while it carries streams (a stopped process whose
connection stays open): the watch abandons its streams only when it is no longer a member AND
does not answer a probe; the request then migrates exactly as on UNAVAILABLE. A slow worker that
is still a member keeps its streams."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from services.gateway.dispatch import Dispatcher, PreparedRequest
from services.gateway.membership import MembershipWatch
from services.gateway.ports import (
    DecodeEvent,
    KvDestination,
    PrefillResult,
    WorkerGone,
    WorkerJob,
    WorkerTarget,
)
from services.gateway.request import OutputFrame, OutputFrameKind, RequestState, RequestStatus
from shared.cluster import FinishReason
from tests.unit.gateway.test_dispatch import (
    ADMITTED,
    DECODE,
    DECODE2,
    PREFILL,
    FakeScheduler,
    FakeStream,
    FakeWorkers,
    disagg,
    final,
    prepared,
    tokens,
)


@dataclass
class FakeMembership:
    """`members`: the scheduler's answer (None: it cannot tell); `alive`: addresses that answer."""

    members_now: frozenset[str] | None = frozenset({"d1", "d2", "p1"})
    alive: set[str] = field(default_factory=set)
    asked: int = 0
    probed: list[str] = field(default_factory=list)

    async def members(self, timeout_s: float) -> frozenset[str] | None:
        self.asked += 1
        return self.members_now

    async def responds(self, address: str, timeout_s: float) -> bool:
        self.probed.append(address)
        return address in self.alive


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


async def test_a_stream_on_a_worker_gone_from_membership_that_does_not_answer_is_abandoned() -> None:
    source = FakeMembership(members_now=frozenset({"d2"}))
    clock = Clock()
    watch = MembershipWatch(source, poll_s=3600, probe_timeout_s=1.5, clock=clock)
    on_d1, on_d2 = FakeStream([]), FakeStream([])
    with watch.tracking(DECODE, on_d1), watch.tracking(DECODE2, on_d2):
        clock.now_s += 1
        assert await watch.check() == ["d1"]
    assert on_d1.abandoned is not None and "d1" in on_d1.abandoned and "1.5 s" in on_d1.abandoned
    assert on_d2.abandoned is None
    assert source.probed == [DECODE.address]
    await watch.close()


async def test_nothing_is_abandoned_while_the_worker_is_a_member_or_membership_is_unknown() -> None:
    source = FakeMembership()
    clock = Clock()
    watch = MembershipWatch(source, poll_s=3600, clock=clock)
    stream = FakeStream([])
    with watch.tracking(DECODE, stream):
        clock.now_s += 1
        assert await watch.check() == []  # a member: not even probed
        source.members_now = None  # the scheduler cannot tell (stale, unreachable)
        assert await watch.check() == []
    assert stream.abandoned is None and source.probed == []
    await watch.close()


async def test_a_worker_that_left_membership_but_answers_keeps_its_streams() -> None:
    """A draining worker deregisters first and finishes its streams; it answers the probe."""
    source = FakeMembership(members_now=frozenset(), alive={DECODE.address})
    clock = Clock()
    watch = MembershipWatch(source, poll_s=3600, clock=clock)
    stream = FakeStream([])
    with watch.tracking(DECODE, stream):
        clock.now_s += 1
        assert await watch.check() == []
    assert stream.abandoned is None and source.probed == [DECODE.address]
    await watch.close()


async def test_a_stream_that_began_after_the_question_is_not_judged_by_its_answer() -> None:
    """The answer may predate the worker's registration (the stream's own Schedule came later)."""
    clock = Clock()

    class Late(FakeMembership):
        async def members(self, timeout_s: float) -> frozenset[str] | None:
            clock.now_s += 1  # the stream below begins while the question is out
            watch_entry.append(watch.tracking(DECODE, stream).__enter__())
            return frozenset()

    source = Late()
    watch = MembershipWatch(source, poll_s=3600, clock=clock)
    stream = FakeStream([])
    watch_entry: list[object] = []
    assert await watch.check() == []
    assert stream.abandoned is None and source.probed == []
    await watch.close()


async def test_polling_runs_only_while_streams_are_tracked() -> None:
    source = FakeMembership()
    watch = MembershipWatch(source, poll_s=0.01)
    with watch.tracking(DECODE, FakeStream([])):
        await asyncio.sleep(0.1)
    asked = source.asked
    assert asked >= 2
    await asyncio.sleep(0.1)
    assert source.asked <= asked + 1 and watch.num_tracked == 0
    await watch.close()


def test_poll_zero_disables_tracking() -> None:
    watch = MembershipWatch(FakeMembership(), poll_s=0)
    with watch.tracking(DECODE, FakeStream([])):
        assert watch.num_tracked == 0


# --- through the request life ---


async def _frames(dispatcher: Dispatcher, req: PreparedRequest, state: RequestState) -> list[OutputFrame]:
    """The request's frames; a stream left waiting on a stopped worker fails the test (30 s)."""

    async def collect() -> list[OutputFrame]:
        return [f async for f in dispatcher.run(req, state, None)]

    return await asyncio.wait_for(collect(), 30)


class HangingAbortWorkers(FakeWorkers):
    """The stopped worker never answers Abort."""

    async def abort(self, address: str, request_id: str) -> bool:
        self.aborts.append(address)
        if address == DECODE.address:
            await asyncio.Event().wait()
        return True


async def test_a_stream_on_a_stopped_worker_that_left_membership_migrates_exactly() -> None:
    """d1 sends 2 tokens and then nothing (SIGSTOP: its connection stays open); its lease expires.
    The stream migrates to d2: prompt + the 3 tokens so far, next output index 3, and the client
    sees every token once; the Abort to the stopped d1 is sent but not waited for."""
    workers = HangingAbortWorkers(
        streams={
            DECODE.address: [FakeStream([ADMITTED, tokens("b", 2), tokens("c", 3)], hang=True)],
            DECODE2.address: [FakeStream([ADMITTED, tokens("e", 5), final("f", 3, FinishReason.LENGTH)])],
        },
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None), PrefillResult("d", (4,), 1, None)]},
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2)])
    source = FakeMembership(members_now=frozenset({"d2", "p1"}))  # d1's lease has expired
    watch = MembershipWatch(source, poll_s=0.02, probe_timeout_s=0.01)
    req = prepared(max_tokens=7, prompt_len=20)
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    frames = await _frames(Dispatcher(sched, workers, 4, membership=watch), req, state)
    assert "".join(f.text for f in frames) == "abcdef"
    assert [t for f in frames for t in f.token_ids] == [1, 2, 3, 4, 5]  # the FINAL carried none
    assert [f.kind for f in frames] == [OutputFrameKind.FIRST] + [OutputFrameKind.CONTINUATION] * 4 + [
        OutputFrameKind.FINAL
    ]
    assert sched.queries[1].exclude_worker_ids == ("d1",)
    assert sched.queries[1].prompt_tokens == 23 and sched.queries[1].max_tokens == 4
    resumed = [j for j in workers.jobs if j.request_id != "req-1"]
    assert {(j.sampling.max_tokens, j.sampling.first_output_index) for j in resumed} == {(4, 3)}
    assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 7
    assert state.migrations == 1 and state.status is RequestStatus.FINISHED_LENGTH
    assert DECODE.address in workers.aborts  # sent, still pending on the stopped worker
    assert source.probed and set(source.probed) == {DECODE.address}
    assert watch.num_tracked == 0


async def test_a_slow_stream_on_a_member_is_not_migrated() -> None:
    """No frame for many polls, but d1 is still a member: the request stays on d1."""
    workers = FakeWorkers(
        streams={
            DECODE.address: [FakeStream([ADMITTED, tokens("b", 2), 0.3, final("c", 2, FinishReason.LENGTH)])]
        },
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    sched = FakeScheduler([disagg(DECODE)])
    source = FakeMembership()
    watch = MembershipWatch(source, poll_s=0.02, probe_timeout_s=0.01)
    req = prepared(max_tokens=3)
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    frames = await _frames(Dispatcher(sched, workers, 4, membership=watch), req, state)
    assert "".join(f.text for f in frames) == "abc"
    assert source.asked >= 5, "the watch polled during the pause"
    assert state.migrations == 0 and len(sched.queries) == 1 and source.probed == []


def test_worker_gone_is_unavailable_for_the_client() -> None:
    from shared.errors import Unavailable

    assert issubclass(WorkerGone, Unavailable)


class StuckPushWorkers(HangingAbortWorkers):
    """The first prefill never returns: its KV push goes to the stopped d1."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.stuck_cancelled = False

    async def prefill(
        self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
    ) -> PrefillResult:
        if kv is not None and kv.address == DECODE.address:
            self.prefill_calls.append((target.address, kv))
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.stuck_cancelled = True
                raise
        return await super().prefill(target, job, kv, timeout_s)


async def test_a_decode_worker_gone_during_the_prefill_is_retried_before_the_handoff() -> None:
    """d1 admitted the request and then stopped; the prefill pushing KV to it would wait for the
    push's timeout. Once d1 is found gone the prefill is cancelled and the request retried on d2
    (nothing reached the client yet): one clean run there, the stuck prefill aborted."""
    workers = StuckPushWorkers(
        streams={
            DECODE.address: [FakeStream([ADMITTED], hang=True)],
            DECODE2.address: [FakeStream([ADMITTED, tokens("b", 2), final("c", 3, FinishReason.LENGTH)])],
        },
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2)])
    source = FakeMembership(members_now=frozenset({"d2", "p1"}))
    watch = MembershipWatch(source, poll_s=0.02, probe_timeout_s=0.01)
    req = prepared(max_tokens=4)
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    frames = await _frames(Dispatcher(sched, workers, 4, membership=watch), req, state)
    assert "".join(f.text for f in frames) == "abc"
    assert frames[0].kind is OutputFrameKind.FIRST and state.migrations == 0 and state.attempts == 2
    assert sched.queries[1].exclude_worker_ids == ("d1",)
    assert workers.stuck_cancelled
    assert PREFILL.address in workers.aborts and DECODE.address in workers.aborts
    assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 4  # 1 + 3


async def test_a_prefill_worker_gone_before_its_handoff_ended_moves_the_request_on() -> None:
    """p1 answered with the first token (reply_before_handoff) and stopped before its KV reached
    d1 (nothing breaks: d1 keeps waiting for a push that never comes); p1's lease expires. The
    request moves on with the first token, p1 excluded; once a decode worker produced a frame,
    its prefill worker is no longer watched."""
    p2 = WorkerTarget("p2", "prefill:2", 0)
    tracked: list[int] = []  # streams the watch tracks as d2's stream is read, per read

    class Counting(FakeStream):
        async def next(self) -> DecodeEvent | None:
            tracked.append(watch.num_tracked)
            return await super().next()

    workers = FakeWorkers(
        streams={
            DECODE.address: [FakeStream([ADMITTED], hang=True)],
            DECODE2.address: [Counting([ADMITTED, tokens("b", 2), final("c", 2, FinishReason.LENGTH)])],
        },
        prefills={
            PREFILL.address: [PrefillResult("a", (1,), 1, None)],
            p2.address: [PrefillResult("x", (9,), 1, None)],
        },
    )
    second = dataclasses.replace(disagg(DECODE2), prefill=p2)
    sched = FakeScheduler([disagg(DECODE), second])
    source = FakeMembership(members_now=frozenset({"d1", "d2", "p2"}))  # p1's lease has expired
    watch = MembershipWatch(source, poll_s=0.02, probe_timeout_s=0.01)
    req = prepared(max_tokens=4, prompt_len=20)
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    frames = await _frames(Dispatcher(sched, workers, 4, membership=watch), req, state)
    assert "".join(f.text for f in frames) == "axbc"
    assert sched.queries[1].exclude_worker_ids == ("p1",)
    assert workers.jobs[-1].prompt_token_ids == (*range(20), 1)
    assert state.migrations == 1 and frames[-1].usage is not None and frames[-1].usage.completion_tokens == 4
    assert set(source.probed) == {PREFILL.address}
    # d2 and p2 until d2's first frame after admission (the KV landed), then d2 alone
    assert tracked == [1, 2, 1]
    assert watch.num_tracked == 0
    await watch.close()
