"""The request life against in-memory fake ports (no grpc): modes, first-token finish, retry
before handoff, cancel and deadline aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from services.gateway.budget import MaxTokens
from services.gateway.capabilities import needed_capabilities
from services.gateway.dispatch import Dispatcher, PreparedRequest
from services.gateway.inputs import Sampling, TokenLogprob
from services.gateway.ports import (
    DecodeEvent,
    KvDestination,
    ModelCard,
    Placement,
    PrefillResult,
    ScheduleQuery,
    WorkerGone,
    WorkerJob,
    WorkerOutOfCapacity,
    WorkerTarget,
    WorkerUnavailable,
)
from services.gateway.request import OutputFrame, OutputFrameKind, RequestState, RequestStatus
from shared.cluster import (
    GATEWAY_TICKET_CAPABILITY,
    NIXL_CAPABILITY,
    NIXL_PARTS_CAPABILITY,
    DecodeFrameKind,
    FinishReason,
    KvTransport,
    ServingMode,
)
from shared.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from shared.structured_output import StructuredOutput

PREFILL = WorkerTarget("p1", "prefill:1", 0)
DECODE = WorkerTarget("d1", "decode:1", 1)
DECODE2 = WorkerTarget("d2", "decode:2", 0)
PROMPT_LPS = tuple(TokenLogprob(t, -1.0 - t) for t in range(1, 20))  # a 20-token prompt's entries

ADMITTED = DecodeEvent(
    DecodeFrameKind.ADMITTED, transfer_ticket="t-1", cached_blocks=1, local_cached_tokens=4
)


def tokens(text: str, *ids: int) -> DecodeEvent:
    return DecodeEvent(DecodeFrameKind.TOKENS, text=text, token_ids=ids)


def final(text: str = "", count: int | None = None, reason: FinishReason = FinishReason.STOP) -> DecodeEvent:
    return DecodeEvent(DecodeFrameKind.FINAL, text=text, generated_tokens=count, finish_reason=reason)


class FakeStream:
    """Events in order; an Exception is raised, a float is a pause (seconds) before the next one.
    `hang`: after the last event, wait until cancelled or abandoned (a stopped worker)."""

    def __init__(self, events: Sequence[DecodeEvent | Exception | float], hang: bool = False) -> None:
        self._events = list(events)
        self._hang = hang
        self.cancelled = False
        self.abandoned: str | None = None
        self.worker_id = ""  # set by FakeWorkers.decode
        self._woken = asyncio.Event()

    async def next(self) -> DecodeEvent | None:
        await asyncio.sleep(0)
        while self._events and isinstance(pause := self._events[0], float):
            self._events.pop(0)
            await asyncio.sleep(pause)
        if self.abandoned is not None:
            raise WorkerGone(self.abandoned, self.worker_id)
        if not self._events:
            if self._hang:
                await self._woken.wait()
                if self.abandoned is not None:
                    raise WorkerGone(self.abandoned, self.worker_id)
            return None
        item = self._events.pop(0)
        if isinstance(item, Exception):
            raise item
        assert isinstance(item, DecodeEvent)
        return item

    def cancel(self) -> None:
        self.cancelled = True

    def abandon(self, reason: str, worker_id: str | None = None) -> None:
        self.abandoned = reason
        self.worker_id = worker_id or self.worker_id
        self._woken.set()


@dataclass
class FakeWorkers:
    streams: dict[str, list[FakeStream]] = field(default_factory=dict)
    prefills: dict[str, list[PrefillResult | Exception]] = field(default_factory=dict)
    decode_calls: list[tuple[str, bool, int]] = field(default_factory=list)
    jobs: list[WorkerJob] = field(default_factory=list)  # every decode and prefill call's job
    prefill_calls: list[tuple[str, KvDestination | None]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    prefill_delay_s: float = 0.0
    tickets: list[str | None] = field(default_factory=list)  # each decode call's transfer_ticket

    def decode(
        self,
        target: WorkerTarget,
        job: WorkerJob,
        local_prefill: bool,
        timeout_s: float | None,
        transfer_ticket: str | None = None,
    ) -> FakeStream:
        self.decode_calls.append((target.address, local_prefill, job.sampling.max_tokens))
        self.tickets.append(transfer_ticket)
        self.jobs.append(job)
        stream = self.streams[target.address].pop(0)
        stream.worker_id = target.worker_id
        return stream

    async def prefill(
        self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
    ) -> PrefillResult:
        self.prefill_calls.append((target.address, kv))
        self.jobs.append(job)
        if self.prefill_delay_s:
            await asyncio.sleep(self.prefill_delay_s)
        item = self.prefills[target.address].pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def abort(self, address: str, request_id: str) -> bool:
        self.aborts.append(address)
        return True


@dataclass
class FakeScheduler:
    placements: list[Placement | Exception]
    queries: list[ScheduleQuery] = field(default_factory=list)
    cards: list[ModelCard] = field(default_factory=list)  # what ListModels lists

    async def schedule(self, query: ScheduleQuery, timeout_s: float | None) -> Placement:
        self.queries.append(query)
        item = self.placements.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def list_models(self) -> Sequence[ModelCard]:
        return self.cards


def disagg(decode: WorkerTarget = DECODE, max_model_len: int = 0) -> Placement:
    return Placement(ServingMode.DISAGGREGATED, decode, PREFILL, "m", max_model_len)


def agg(decode: WorkerTarget = DECODE) -> Placement:
    return Placement(ServingMode.AGGREGATED, decode, None, "m", 0)


def prepared(max_tokens: int | None = 8, prompt_len: int = 20) -> PreparedRequest:
    return PreparedRequest(
        request_id="req-1",
        model="",
        prompt_token_ids=tuple(range(prompt_len)),
        sampling=Sampling(),
        max_tokens=MaxTokens(max_tokens, 256),
        return_token_ids=True,
    )


async def run(
    sched: FakeScheduler,
    workers: FakeWorkers,
    req: PreparedRequest | None = None,
    deadline_s: float | None = None,
) -> tuple[list[OutputFrame], RequestState]:
    req = req or prepared()
    state = RequestState(req.request_id, req.prompt_token_ids, req.return_token_ids, "m")
    frames = [f async for f in Dispatcher(sched, workers, block_size=4).run(req, state, deadline_s)]
    return frames, state


async def test_kv_transport_is_nixl_only_when_both_workers_offer_it() -> None:
    """NIXL when both workers offer it; in parts (KvTarget.nixl_parts, 1.10) only when both
    also offer kv_nixl_parts: an older one of the pair gets the one message at the end."""
    from services.gateway import convert

    parts = (NIXL_CAPABILITY, NIXL_PARTS_CAPABILITY)
    nixl_prefill = WorkerTarget("p1", "prefill:1", 0, ("generated_tokens", NIXL_CAPABILITY))
    parts_prefill = WorkerTarget("p1", "prefill:1", 0, ("generated_tokens", *parts))
    nixl_decode = WorkerTarget("d1", "decode:1", 1, (NIXL_CAPABILITY,))
    parts_decode = WorkerTarget("d1", "decode:1", 1, parts)
    grpc_only = WorkerTarget("d1", "decode:1", 1, (NIXL_PARTS_CAPABILITY,))  # no NIXL agent
    cases = (
        (nixl_prefill, nixl_decode, KvTransport.NIXL, False),
        (nixl_prefill, DECODE, KvTransport.GRPC_PUSH, False),
        (parts_prefill, parts_decode, KvTransport.NIXL, True),
        (parts_prefill, nixl_decode, KvTransport.NIXL, False),
        (nixl_prefill, parts_decode, KvTransport.NIXL, False),
        (parts_prefill, grpc_only, KvTransport.GRPC_PUSH, False),
    )
    job = WorkerJob("r", (1, 2), Sampling(max_tokens=4), False)
    for prefill, decode, transport, nixl_parts in cases:
        workers = FakeWorkers(
            streams={decode.address: [FakeStream([ADMITTED, final("d", 1)])]},
            prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
        )
        placement = Placement(ServingMode.DISAGGREGATED, decode, prefill, "m", 0)
        await run(FakeScheduler([placement]), workers)
        kv = KvDestination(
            decode.address, 1, "t-1", 1, transport, nixl_parts=nixl_parts, reply_before_handoff=True
        )
        assert workers.prefill_calls == [(PREFILL.address, kv)]
        target = convert.prefill_request(job, 0, kv).kv_target
        assert target.HasField("nixl_parts") == nixl_parts and target.nixl_parts == nixl_parts
        assert target.reply_before_handoff


NIXL_TICKETS = ("generated_tokens", NIXL_CAPABILITY, GATEWAY_TICKET_CAPABILITY)


async def test_over_nixl_the_prefill_starts_with_the_admission_under_the_gateways_ticket() -> None:
    """A decode worker that takes the gateway's ticket (kv_gateway_ticket, 1.11), over NIXL: the
    Prefill call goes out before ADMITTED came back, its KV target naming the ticket the Decode
    call carried ("<dp_rank>-..."), no blocks skipped (the decode worker READs only the blocks
    it lacks); the request runs as usual. Over the gRPC push, or to an older decode worker, the
    prefill waits for ADMITTED and its figures."""
    order: list[str] = []

    class Logged(FakeStream):
        async def next(self) -> DecodeEvent | None:
            event = await super().next()
            order.append(event.kind.value if event else "end")
            return event

    class LoggedWorkers(FakeWorkers):
        async def prefill(
            self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
        ) -> PrefillResult:
            order.append("prefill")
            return await super().prefill(target, job, kv, timeout_s)

    prefill = WorkerTarget("p1", "prefill:1", 0, NIXL_TICKETS)
    decode = WorkerTarget("d1", "decode:1", 1, NIXL_TICKETS)
    workers = LoggedWorkers(
        streams={decode.address: [Logged([0.05, ADMITTED, tokens("b", 2), final("c", 3)])]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    placement = Placement(ServingMode.DISAGGREGATED, decode, prefill, "m", 0)
    frames, state = await run(FakeScheduler([placement]), workers)
    assert "".join(f.text for f in frames) == "abc" and state.status is RequestStatus.FINISHED_STOPPED
    assert order[:2] == ["prefill", "admitted"]
    (ticket,) = workers.tickets
    assert ticket is not None and ticket.startswith("1-") and len(ticket) > 10
    kv = KvDestination(decode.address, 1, ticket, 0, KvTransport.NIXL, None, False, True)
    assert workers.prefill_calls == [(PREFILL.address, kv)]
    assert "admit" in state.ttft_phases_s and "prefill" in state.ttft_phases_s

    # the gRPC push (no NIXL on the prefill worker): the ticket and the figures of ADMITTED
    order.clear()
    workers = LoggedWorkers(
        streams={decode.address: [Logged([ADMITTED, final("d", 1)])]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    placement = Placement(ServingMode.DISAGGREGATED, decode, PREFILL, "m", 0)
    await run(FakeScheduler([placement]), workers)
    assert order[:2] == ["admitted", "prefill"] and workers.tickets == [None]
    assert workers.prefill_calls[0][1] == KvDestination(
        decode.address, 1, "t-1", 1, reply_before_handoff=True
    )


async def test_an_admission_that_fails_while_the_prefill_runs_cancels_it_and_retries() -> None:
    prefill = WorkerTarget("p1", "prefill:1", 0, NIXL_TICKETS)
    decode = WorkerTarget("d1", "decode:1", 1, NIXL_TICKETS)
    decode2 = WorkerTarget("d2", "decode:2", 0, NIXL_TICKETS)
    cancelled: list[str] = []

    class SlowWorkers(FakeWorkers):
        async def prefill(
            self, target: WorkerTarget, job: WorkerJob, kv: KvDestination | None, timeout_s: float | None
        ) -> PrefillResult:
            if job.request_id == "req-1":  # the first attempt: still running when d1 refuses
                try:
                    await asyncio.sleep(5)
                except asyncio.CancelledError:
                    cancelled.append(job.request_id)
                    raise
            return await super().prefill(target, job, kv, timeout_s)

    workers = SlowWorkers(
        streams={
            decode.address: [FakeStream([WorkerOutOfCapacity("no KV blocks", "d1")])],
            decode2.address: [FakeStream([ADMITTED, final("d", 1)])],
        },
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    sched = FakeScheduler(
        [
            Placement(ServingMode.DISAGGREGATED, decode, prefill, "m", 0),
            Placement(ServingMode.DISAGGREGATED, decode2, prefill, "m", 0),
        ]
    )
    frames, state = await run(sched, workers)
    assert "".join(f.text for f in frames) == "ad" and state.attempts == 2
    assert cancelled == ["req-1"]
    assert PREFILL.address in workers.aborts and decode.address in workers.aborts
    assert sched.queries[1].exclude_worker_ids == ("d1",)


async def test_the_decode_workers_trim_reaches_the_prefill_worker_and_changes_no_usage() -> None:
    """DecodeFrame.trim_blocks (1.8) is passed on as KvTarget.trim_blocks, separate from
    skip_blocks (cached_blocks), and usage stays the prefill worker's figures; a frame without
    it (an older decode worker) leaves KvTarget.trim_blocks unset (an older prefill worker
    ignores it either way)."""
    from services.gateway import convert
    from shared.proto import worker_pb2

    admitted = dataclasses.replace(ADMITTED, trim_blocks=5)
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([admitted, final("d", 1)])]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None, local_cached_tokens=8)]},
    )
    frames, _ = await run(FakeScheduler([disagg()]), workers)
    kv = KvDestination(DECODE.address, 1, "t-1", 1, trim_blocks=5, reply_before_handoff=True)
    assert workers.prefill_calls == [(PREFILL.address, kv)]
    assert all(f.cached_tokens == 8 for f in frames)

    assert (
        convert.decode_event(
            worker_pb2.DecodeFrame(kind=worker_pb2.DECODE_FRAME_KIND_ADMITTED, trim_blocks=5)
        ).trim_blocks
        == 5
    )
    assert (
        convert.decode_event(worker_pb2.DecodeFrame(kind=worker_pb2.DECODE_FRAME_KIND_ADMITTED)).trim_blocks
        is None
    )
    job = WorkerJob("r", (1, 2), Sampling(max_tokens=4), False)
    target = convert.prefill_request(job, 0, kv).kv_target
    assert target.HasField("trim_blocks") and (target.trim_blocks, target.skip_blocks) == (5, 1)
    untrimmed = KvDestination(DECODE.address, 1, "t-1", 1)
    assert not convert.prefill_request(job, 0, untrimmed).kv_target.HasField("trim_blocks")


async def test_disaggregated_path() -> None:
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED, tokens("b", 2), tokens("", 3), final("d", 3)])]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None, local_cached_tokens=8)]},
    )
    sched = FakeScheduler([disagg()])
    frames, state = await run(sched, workers)
    assert [f.kind for f in frames] == [
        OutputFrameKind.FIRST,
        OutputFrameKind.CONTINUATION,
        OutputFrameKind.CONTINUATION,
        OutputFrameKind.FINAL,
    ]
    assert "".join(f.text for f in frames) == "abd"
    assert workers.decode_calls == [(DECODE.address, False, 8)]
    assert workers.prefill_calls == [
        (PREFILL.address, KvDestination(DECODE.address, 1, "t-1", 1, reply_before_handoff=True))
    ]
    usage = frames[-1].usage
    assert usage is not None and usage.completion_tokens == 4
    assert frames[-1].finish_reason is FinishReason.STOP
    # cached = the prefill worker's prefix hits (8); the decode side's admission figure (4) is not
    assert all(f.prompt_tokens == 20 and f.cached_tokens == 8 for f in frames)
    assert (usage.cache.local_tokens, usage.cache.transferred_tokens) == (0, 8)
    assert len(sched.queries[0].prefix_block_hashes) == 5
    assert workers.aborts == []
    assert state.status is RequestStatus.FINISHED_STOPPED


async def test_prefill_finishes_request_aborts_decode() -> None:
    stream = FakeStream([ADMITTED], hang=True)
    workers = FakeWorkers(
        streams={DECODE.address: [stream]},
        prefills={PREFILL.address: [PrefillResult("", (), 0, FinishReason.STOP)]},
    )
    frames, _state = await run(FakeScheduler([disagg()]), workers)
    assert [f.kind for f in frames] == [OutputFrameKind.FINAL]
    assert frames[0].usage is not None and frames[0].usage.completion_tokens == 0
    assert frames[0].finish_reason is FinishReason.STOP
    assert stream.cancelled
    assert workers.aborts == [DECODE.address]


async def test_aggregated_path_first_frame_is_first() -> None:
    workers = FakeWorkers(
        streams={
            DECODE.address: [
                FakeStream([DecodeEvent(DecodeFrameKind.ADMITTED), tokens("x"), tokens("y"), final("", 2)])
            ]
        }
    )
    frames, _ = await run(FakeScheduler([agg()]), workers)
    assert [f.kind for f in frames] == [
        OutputFrameKind.FIRST,
        OutputFrameKind.CONTINUATION,
        OutputFrameKind.FINAL,
    ]
    assert workers.decode_calls == [(DECODE.address, True, 8)]


async def test_retry_before_handoff_excludes_failed_decode_worker() -> None:
    workers = FakeWorkers(
        streams={
            DECODE.address: [FakeStream([WorkerUnavailable("down", "d1")])],
            DECODE2.address: [FakeStream([ADMITTED, final("z", 1)])],
        },
        prefills={PREFILL.address: [PrefillResult("y", (5,), 1, None)]},
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2)])
    frames, state = await run(sched, workers)
    assert sched.queries[1].exclude_worker_ids == ("d1",)
    assert "".join(f.text for f in frames) == "yz"
    assert DECODE.address in workers.aborts
    assert state.attempts == 2


async def test_retry_after_prefill_unavailable_aborts_admitted_decode() -> None:
    first_stream = FakeStream([ADMITTED], hang=True)
    workers = FakeWorkers(
        streams={DECODE.address: [first_stream, FakeStream([ADMITTED, final("", 1)])]},
        prefills={PREFILL.address: [WorkerUnavailable("gone", "p1"), PrefillResult("a", (), 1, None)]},
    )
    sched = FakeScheduler([disagg(), disagg()])
    frames, _ = await run(sched, workers)
    assert sched.queries[1].exclude_worker_ids == ("p1",)
    assert first_stream.cancelled
    assert sorted(workers.aborts) == sorted([DECODE.address, PREFILL.address])
    assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 2


async def test_retries_before_handoff_are_bounded() -> None:
    sched = FakeScheduler([WorkerUnavailable("no workers")] * 3)
    with pytest.raises(WorkerUnavailable):
        await run(sched, FakeWorkers())
    assert len(sched.queries) == 3


async def test_retries_and_migrations_pause_with_the_jittered_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each retry before handoff and each migration waits backoff_s(its number) first: two
    retries (1, 2), then after the handoff two migrations (1, 2)."""
    from services.gateway import dispatch

    pauses: list[int] = []

    def recorded(attempt: int) -> float:
        pauses.append(attempt)
        return 0.0

    monkeypatch.setattr(dispatch, "backoff_s", recorded)
    workers = FakeWorkers(
        streams={
            DECODE.address: [
                FakeStream([WorkerUnavailable("down", "d1")]),
                FakeStream([ADMITTED, tokens("b", 2), WorkerUnavailable("died", "d1")]),
            ],
            DECODE2.address: [
                FakeStream([WorkerUnavailable("down", "d2")]),
                FakeStream([ADMITTED, tokens("d", 4), WorkerUnavailable("died", "d2")]),
                FakeStream([ADMITTED, final("f", 1, FinishReason.LENGTH)]),
            ],
        },
        prefills={
            PREFILL.address: [PrefillResult(t, (i,), 1, None) for i, t in ((1, "a"), (3, "c"), (5, "e"))]
        },
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2), disagg(DECODE), disagg(DECODE2), disagg(DECODE2)])
    frames, state = await run(sched, workers, prepared(max_tokens=6))
    assert "".join(f.text for f in frames) == "abcdef"
    assert state.attempts == 5 and state.migrations == 2
    assert pauses == [1, 2, 1, 2]


async def test_a_backoff_longer_than_the_deadline_ends_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.gateway import dispatch

    monkeypatch.setattr(dispatch, "backoff_s", lambda attempt: 3600.0)
    workers = FakeWorkers(streams={DECODE.address: [FakeStream([WorkerUnavailable("down", "d1")])]})
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2)])
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(run(sched, workers, deadline_s=time.monotonic() + 0.2), 30)
    assert len(sched.queries) == 1  # the pause was cut to the deadline, then nothing was retried


async def test_no_retry_after_handoff_with_migration_disabled() -> None:
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED, tokens("b"), WorkerUnavailable("died", "d1")])]},
        prefills={PREFILL.address: [PrefillResult("a", (), 1, None)]},
    )
    sched = FakeScheduler([disagg(), disagg()])
    got: list[OutputFrame] = []
    req = prepared()
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    with pytest.raises(WorkerUnavailable):
        async for f in Dispatcher(sched, workers, 4, migration_limit=0).run(req, state, None):
            got.append(f)
    assert len(got) == 2
    assert len(sched.queries) == 1
    assert sorted(workers.aborts) == sorted([DECODE.address, PREFILL.address])
    assert state.status is RequestStatus.FAILED


# (max_model_len the model's card lists before scheduling, the placement's max_model_len);
# 0 = unknown. The budget is resolved on the card; the placement is only a re-check.
LISTED = (24, 24)  # known before scheduling
PLACED_ONLY = (0, 24)  # the card says nothing: only the placement's workers limit it
SHRUNK = (100, 24)  # membership changed between the listing and the placement


@pytest.mark.parametrize(("listed", "placed"), [LISTED, PLACED_ONLY, SHRUNK])
async def test_explicit_max_tokens_too_large_refused_before_any_worker_call(listed: int, placed: int) -> None:
    """20 prompt tokens + max_tokens 8 > 24: refused (INVALID_ARGUMENT, the same message) before
    the Schedule call when the model's card tells, else on the placement; never a worker call."""
    sched = FakeScheduler([disagg(max_model_len=placed)], cards=[ModelCard("m", listed)] if listed else [])
    workers = FakeWorkers()
    req = prepared(max_tokens=8, prompt_len=20)
    state = RequestState(req.request_id, req.prompt_token_ids, req.return_token_ids, "m")
    too_long = r"exceeds the model's max_model_len \(24\); set max_tokens <= 4"
    with pytest.raises(InvalidArgument, match=too_long):
        _ = [f async for f in Dispatcher(sched, workers, block_size=4).run(req, state, None)]
    assert len(sched.queries) == (0 if listed == placed else 1)  # no Schedule call when listed
    assert workers.decode_calls == [] and workers.prefill_calls == [] and workers.aborts == []
    assert state.status is RequestStatus.FAILED


@pytest.mark.parametrize(("listed", "placed"), [LISTED, PLACED_ONLY, SHRUNK])
async def test_unset_max_tokens_shortened_to_fit(listed: int, placed: int) -> None:
    """An unset max_tokens (default 256) with a 20-token prompt on 24-token workers: 4 tokens.
    The scheduler is told the budget resolved on the model's card (4, or 80 on a 100-token card,
    or the default when nothing is listed); the workers get the placement's figure."""
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED, final("", 3)])]},
        prefills={PREFILL.address: [PrefillResult("a", (), 1, None)]},
    )
    sched = FakeScheduler([disagg(max_model_len=placed)], cards=[ModelCard("m", listed)] if listed else [])
    frames, state = await run(sched, workers, prepared(max_tokens=None))
    assert sched.queries[0].max_tokens == {24: 4, 100: 80, 0: 256}[listed]
    assert workers.decode_calls[0][2] == 4 and state.max_tokens == 4
    assert frames[-1].finish_reason is FinishReason.LENGTH
    assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 4


async def test_deadline_aborts_both_workers() -> None:
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED], hang=True)]},
        prefills={PREFILL.address: [PrefillResult("a", (), 1, None)]},
    )
    with pytest.raises(DeadlineExceeded):
        await run(FakeScheduler([disagg()]), workers, deadline_s=time.monotonic() + 0.2)
    assert sorted(workers.aborts) == sorted([DECODE.address, PREFILL.address])


async def test_cancel_during_prefill_aborts_both_workers() -> None:
    stream = FakeStream([ADMITTED], hang=True)
    workers = FakeWorkers(
        streams={DECODE.address: [stream]},
        prefills={PREFILL.address: [PrefillResult("a", (), 1, None)]},
        prefill_delay_s=10,
    )
    task = asyncio.ensure_future(run(FakeScheduler([disagg()]), workers))
    while not workers.prefill_calls:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.cancelled
    assert sorted(workers.aborts) == sorted([DECODE.address, PREFILL.address])


async def test_deadline_during_prefill_ends_aborted_with_a_finish_reason() -> None:
    """Logged and counted as finished (abort), not left in `prefilling` with no finish reason."""
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED], hang=True)]},
        prefills={PREFILL.address: [PrefillResult("a", (), 1, None)]},
        prefill_delay_s=10,
    )
    req = prepared()
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    with pytest.raises(DeadlineExceeded):
        async for _ in Dispatcher(FakeScheduler([disagg()]), workers, 4).run(
            req, state, time.monotonic() + 0.2
        ):
            pass
    assert state.status is RequestStatus.FINISHED_ABORTED
    assert state.finish_reason is FinishReason.ABORT


class SlowAbortWorkers(FakeWorkers):
    async def abort(self, address: str, request_id: str) -> bool:
        await asyncio.sleep(0.2)
        return await super().abort(address, request_id)


async def test_second_cancel_while_aborting_still_ends_the_state() -> None:
    workers = SlowAbortWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED], hang=True)]},
        prefills={PREFILL.address: [PrefillResult("a", (), 1, None)]},
        prefill_delay_s=10,
    )
    req = prepared()
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")

    async def consume() -> None:
        async for _ in Dispatcher(FakeScheduler([disagg()]), workers, 4).run(req, state, None):
            pass

    task = asyncio.ensure_future(consume())
    while not workers.prefill_calls:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.05)  # now inside the aborts
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state.status is RequestStatus.FINISHED_ABORTED
    await asyncio.sleep(0.3)
    assert sorted(workers.aborts) == sorted([DECODE.address, PREFILL.address])


async def test_max_tokens_0_disaggregated_runs_the_prefill_alone() -> None:
    """Prompt scoring (max_tokens 0 with prompt logprobs): one Prefill with no KV target, no
    decode worker called or aborted, a FINAL frame with the prompt logprobs, LENGTH, 0 tokens."""
    workers = FakeWorkers(
        prefills={
            PREFILL.address: [PrefillResult("", (), 0, FinishReason.LENGTH, prompt_logprobs=PROMPT_LPS)]
        }
    )
    req = prepared(max_tokens=0)
    req = dataclasses.replace(
        req, sampling=dataclasses.replace(req.sampling, max_tokens=0, prompt_logprobs=1)
    )
    frames, state = await run(FakeScheduler([disagg()]), workers, req)
    assert workers.prefill_calls == [(PREFILL.address, None)] and workers.decode_calls == []
    assert workers.aborts == [] and workers.jobs[0].sampling.prompt_logprobs == 1
    (frame,) = frames
    assert frame.kind is OutputFrameKind.FINAL and frame.finish_reason is FinishReason.LENGTH
    assert frame.usage is not None and frame.usage.completion_tokens == 0
    assert frame.prompt_logprobs == PROMPT_LPS and frame.prompt_token_ids == req.prompt_token_ids
    assert state.status is RequestStatus.FINISHED_LENGTH


# --- migration after handoff ---


async def test_decode_failure_mid_stream_migrates_and_continues_exactly() -> None:
    """d1 dies after 3 tokens (ids 1, 2, 3); the request goes on at d2 with prompt + those ids,
    the remaining max_tokens and the next output index; the client sees each token once."""
    workers = FakeWorkers(
        streams={
            DECODE.address: [
                FakeStream([ADMITTED, tokens("b", 2), tokens("c", 3), WorkerUnavailable("died", "d1")])
            ],
            DECODE2.address: [FakeStream([ADMITTED, tokens("e", 5), final("f", 3, FinishReason.LENGTH)])],
        },
        prefills={
            PREFILL.address: [
                PrefillResult("a", (1,), 1, None, prompt_logprobs=PROMPT_LPS),
                PrefillResult("d", (4,), 1, None),
            ]
        },
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2)])
    req = prepared(max_tokens=7, prompt_len=20)
    penalized = dataclasses.replace(
        req.sampling,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias=((9, 3.0),),
        min_tokens=6,
        prompt_logprobs=2,
    )
    req = dataclasses.replace(req, sampling=penalized)
    state = RequestState(req.request_id, req.prompt_token_ids, False, "m")
    frames = [f async for f in Dispatcher(sched, workers, 4).run(req, state, None)]
    assert "".join(f.text for f in frames) == "abcdef"
    assert [f.kind for f in frames] == [OutputFrameKind.FIRST] + [OutputFrameKind.CONTINUATION] * 4 + [
        OutputFrameKind.FINAL
    ]
    assert all(f.token_ids == () for f in frames), "ids only when the client asked"
    assert sched.queries[1].exclude_worker_ids == ("d1",)
    assert sched.queries[1].prompt_tokens == 23 and sched.queries[1].max_tokens == 4
    resumed = [j for j in workers.jobs if j.request_id != "req-1"]
    assert {j.prompt_token_ids for j in resumed} == {(*range(20), 1, 2, 3)}
    assert {(j.sampling.max_tokens, j.sampling.first_output_index) for j in resumed} == {(4, 3)}
    # penalties travel unchanged; min_tokens counts from output index 0 (the worker compares it
    # with first_output_index + its own output), so it is not shortened like max_tokens
    for job in workers.jobs:
        assert (job.sampling.presence_penalty, job.sampling.repetition_penalty) == (0.5, 1.2)
        assert job.sampling.logit_bias == ((9, 3.0),) and job.sampling.min_tokens == 6
    assert all(j.return_token_ids for j in workers.jobs), "workers always return ids to the gateway"
    # prompt logprobs: asked of the first run only, on the first frame only (with the prompt's ids)
    assert [j.sampling.prompt_logprobs for j in workers.jobs] == [2, 2, None, None]
    assert frames[0].prompt_logprobs == PROMPT_LPS and frames[0].prompt_token_ids == tuple(range(20))
    assert not any(f.prompt_logprobs or f.prompt_token_ids for f in frames[1:])
    usage = frames[-1].usage
    assert usage is not None and usage.completion_tokens == 7  # 3 before + 1 (prefill) + 3 (decode)
    assert frames[-1].finish_reason is FinishReason.LENGTH
    assert usage.prompt_tokens == 20
    assert state.migrations == 1 and state.status is RequestStatus.FINISHED_LENGTH
    assert DECODE.address in workers.aborts


async def test_a_handoff_that_fails_after_the_first_token_moves_the_request_on() -> None:
    """The prefill worker answered at the first token (reply_before_handoff) and its handoff
    then broke: the decode worker ends the request with ABORT before any token. The request
    moves on (a migration excluding that prefill worker) with the first token in its prompt; the
    client sees each token once and no abort. An ABORT after a token is the worker's to report."""
    workers = FakeWorkers(
        streams={
            DECODE.address: [FakeStream([ADMITTED, final("", 0, FinishReason.ABORT)])],
            DECODE2.address: [FakeStream([ADMITTED, tokens("c", 3), final("", 2, FinishReason.LENGTH)])],
        },
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None), PrefillResult("b", (2,), 1, None)]},
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2)])
    frames, state = await run(sched, workers, prepared(max_tokens=4))
    assert "".join(f.text for f in frames) == "abc"
    assert frames[-1].finish_reason is FinishReason.LENGTH
    assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 4
    assert sched.queries[1].exclude_worker_ids == ("p1",)
    assert workers.jobs[-1].prompt_token_ids == (*range(20), 1)
    assert state.migrations == 1 and DECODE.address in workers.aborts

    # after a token, or without reply_before_handoff, an ABORT is relayed as the worker's finish
    for events, early in (
        ([ADMITTED, tokens("b", 2), final("", 1, FinishReason.ABORT)], True),
        ([ADMITTED, final("", 0, FinishReason.ABORT)], False),
    ):
        workers = FakeWorkers(
            streams={DECODE.address: [FakeStream(events)]},
            prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
        )
        sched = FakeScheduler([disagg()])
        req = prepared()
        state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
        dispatcher = Dispatcher(sched, workers, 4, first_token_before_handoff=early)
        frames = [f async for f in dispatcher.run(req, state, None)]
        assert frames[-1].finish_reason is FinishReason.ABORT and len(sched.queries) == 1
        assert workers.prefill_calls[0][1] is not None
        assert workers.prefill_calls[0][1].reply_before_handoff is early

    # with migration off, the first token waits for the handoff (its failure is retried unseen)
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED, final("d", 1)])]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    req = prepared()
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    _ = [
        f
        async for f in Dispatcher(FakeScheduler([disagg()]), workers, 4, migration_limit=0).run(
            req, state, None
        )
    ]
    assert workers.prefill_calls[0][1] is not None and not workers.prefill_calls[0][1].reply_before_handoff


async def test_migration_limit_ends_with_unavailable_naming_the_failure() -> None:
    def dying(worker: str) -> FakeStream:
        return FakeStream([ADMITTED, tokens("x", 9), WorkerUnavailable(f"{worker} died", worker)])

    workers = FakeWorkers(
        streams={DECODE.address: [dying("d1"), dying("d1")], DECODE2.address: [dying("d2")]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)] * 3},
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2), disagg(DECODE)])
    req = prepared(max_tokens=50)
    state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
    got: list[OutputFrame] = []
    with pytest.raises(WorkerUnavailable, match=r"d1 died.*gave up after 2 migration\(s\)"):
        async for f in Dispatcher(sched, workers, 4, migration_limit=2).run(req, state, None):
            got.append(f)
    assert "".join(f.text for f in got) == "axaxax"
    assert state.status is RequestStatus.FAILED and len(sched.queries) == 3


async def test_worker_death_after_the_last_token_finishes_without_a_new_run() -> None:
    workers = FakeWorkers(
        streams={DECODE.address: [FakeStream([ADMITTED, tokens("b", 2), WorkerUnavailable("died", "d1")])]},
        prefills={PREFILL.address: [PrefillResult("a", (1,), 1, None)]},
    )
    sched = FakeScheduler([disagg()])
    frames, _state = await run(sched, workers, prepared(max_tokens=2))
    assert frames[-1].kind is OutputFrameKind.FINAL and frames[-1].finish_reason is FinishReason.LENGTH
    assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == 2
    assert len(sched.queries) == 1


async def test_open_breaker_keeps_a_failing_worker_out_of_the_next_requests() -> None:
    from services.gateway.breaker import CircuitBreakers

    breakers = CircuitBreakers(failure_threshold=1, cooldown_s=60)
    workers = FakeWorkers(
        streams={
            DECODE.address: [FakeStream([WorkerUnavailable("down", "d1")])],
            DECODE2.address: [FakeStream([ADMITTED, final("z", 1)]), FakeStream([ADMITTED, final("y", 1)])],
        },
        prefills={PREFILL.address: [PrefillResult("x", (5,), 1, None)] * 2},
    )
    sched = FakeScheduler([disagg(DECODE), disagg(DECODE2), disagg(DECODE2)])
    dispatcher = Dispatcher(sched, workers, 4, breakers=breakers)
    for _ in range(2):
        req = prepared()
        state = RequestState(req.request_id, req.prompt_token_ids, True, "m")
        [f async for f in dispatcher.run(req, state, None)]
    assert sched.queries[1].exclude_worker_ids == ("d1",)  # the retry of the first request
    assert sched.queries[2].exclude_worker_ids == ("d1",)  # the next request: breaker open
    assert breakers.is_open("d1") and not breakers.is_open("d2")


# --- features an older worker would silently ignore ---


async def test_a_worker_without_a_needed_capability_is_skipped_then_the_request_refused() -> None:
    old = WorkerTarget("old", "old:1", 0, ("generated_tokens", "first_output_index"))
    new = WorkerTarget("d2", "decode:2", 0, ("generated_tokens", "logprobs", "sampling_penalties"))
    workers = FakeWorkers(streams={new.address: [FakeStream([tokens("a", 1), final("b", 2)])]})
    sched = FakeScheduler([agg(old), agg(new)])
    req = prepared()
    req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, logprobs=2, min_tokens=1))
    frames, _ = await run(sched, workers, req)
    assert "".join(f.text for f in frames) == "ab"
    assert sched.queries[1].exclude_worker_ids == ("old",)
    assert len(workers.jobs) == 1  # the old worker got nothing
    # structured outputs: nobody has them -> RESOURCE_EXHAUSTED naming what is missing
    sched = FakeScheduler([agg(old), agg(new), agg(new)])
    req = dataclasses.replace(
        req, sampling=dataclasses.replace(req.sampling, structured=StructuredOutput("json_object"))
    )
    with pytest.raises(ResourceExhausted, match="lacks structured_outputs"):
        await run(sched, FakeWorkers(), req)
    # a plain request goes to the old worker; targets without capabilities are not checked
    assert needed_capabilities(prepared().sampling) == set()
    assert needed_capabilities(dataclasses.replace(prepared().sampling, min_p=0.1)) == {"min_p"}
    grammar = dataclasses.replace(prepared().sampling, structured=StructuredOutput("grammar", 'root ::= "a"'))
    # an older worker would see an empty constraint: it must advertise structured_grammar
    assert needed_capabilities(grammar) == {"structured_outputs", "structured_grammar"}
    # an older worker would share its prefix cache across salts
    assert needed_capabilities(dataclasses.replace(prepared().sampling, cache_salt="t")) == {"cache_salt"}
    # an older worker would hide the special tokens a client asked to see
    shown = dataclasses.replace(prepared().sampling, skip_special_tokens=False)
    assert needed_capabilities(shown) == {"show_special_tokens"}
    # as a hint (Mistral's call markers) an older worker may serve it: it hides them, and the
    # parser reads its calls at the output's start as before
    assert needed_capabilities(dataclasses.replace(shown, special_tokens_hint=True)) == set()


async def test_priority_goes_with_every_worker_call_and_needs_no_capability() -> None:
    """A hint: an older worker (no "priority" capability) still gets the request."""
    old = WorkerTarget("old", "old:1", 0, ("generated_tokens",))
    workers = FakeWorkers(streams={old.address: [FakeStream([final("x", 1)])]})
    frames, _ = await run(FakeScheduler([agg(old)]), workers, dataclasses.replace(prepared(), priority=7))
    assert frames[-1].text == "x"
    assert [j.priority for j in workers.jobs] == [7]
    plain_workers = FakeWorkers(streams={old.address: [FakeStream([final("x", 1)])]})
    frames, _ = await run(FakeScheduler([agg(old)]), plain_workers)
    assert frames[-1].text == "x"
