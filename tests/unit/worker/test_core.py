"""WorkerCore paths that are hard to reach over real servers, against a recording fake engine."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from services.worker.core import WorkerCore
from services.worker.engine.api import (
    EngineRequest,
    KvBlocksChunk,
    RequestOutput,
    SamplingConfig,
)
from services.worker.kv_nixl import KvTransferFailed
from services.worker.kv_receive import KvLoadFailurePolicy, KvReceiver
from services.worker.messages import (
    CAPABILITIES,
    PROTO_VERSION,
    IncomingKvChunk,
    KvPushResult,
    KvTargetSpec,
    NixlSource,
    PrefillCall,
)
from shared import errors
from shared.cluster import FinishReason, KvLayout, Role, WorkerInfo

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


class FakeHandle:
    def __init__(self, outputs: list[RequestOutput]) -> None:
        self._outputs = outputs

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        for out in self._outputs:
            yield out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()


class FakeEngine:
    """Records the calls the core makes; PREFILL_ONLY yields one first-token output."""

    max_model_len = 64
    kv_layout = LAYOUT
    model_id = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_import_at: int | None = None

    def add_request(self, request: EngineRequest) -> FakeHandle:
        self.calls.append(("add", request.request_id, request.kind))
        return FakeHandle(
            [
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=(7,),
                    text_delta="x",
                    finished=True,
                    finish_reason=None,
                    num_generated_tokens=1,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_local_cached_tokens=0,
                    num_transferred_tokens=0,
                    num_prefill_chunks=1,
                    prefill_ns=5,
                )
            ]
        )

    def export_kv(
        self, request_id: str, skip_blocks: int, max_chunk_bytes: int, trim_blocks: int = 0
    ) -> Iterator[KvBlocksChunk]:
        self.calls.append(("export", request_id, skip_blocks))
        yield KvBlocksChunk(first_block=skip_blocks, num_blocks=1, data=b"\0" * 8)

    def import_kv(self, ticket: str, chunk: KvBlocksChunk) -> None:
        n = sum(1 for c in self.calls if c[0] == "import")
        self.calls.append(("import", ticket, chunk.first_block))
        if self.fail_import_at == n:
            raise errors.InvalidArgument("bad chunk")

    def import_kv_direct(self, ticket: str, first_block: int, num_blocks: int, read: Any) -> int:
        self.calls.append(("read", ticket, first_block, num_blocks))
        return int(read(0, 0, list(range(first_block, first_block + num_blocks)), 0, ()))

    def finish_import(
        self,
        ticket: str,
        num_tokens: int,
        first_token_id: int | None,
        prefill_generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> None:
        call: tuple[Any, ...] = ("finish", ticket, num_tokens, first_token_id, prefill_generated_tokens)
        call += (draft_token_ids,) if draft_token_ids else ()
        self.calls.append(call + (("recompute",) if recompute else ()))

    def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))

    def abort(self, request_id: str) -> bool:
        self.calls.append(("abort", request_id))
        return True

    def waits_for_kv(self, ticket: str) -> bool:
        return True

    def abort_ticket(self, ticket: str) -> bool:
        self.calls.append(("abort_ticket", ticket))
        return True


class RecordingPusher:
    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    async def push(self, **kwargs: Any) -> KvPushResult:
        list(kwargs["chunks"])
        self.kwargs = kwargs
        return KvPushResult(bytes_sent=8, num_chunks=1, seconds=0.001)


class FailingPusher:
    async def push(self, **kwargs: Any) -> KvPushResult:
        list(kwargs["chunks"])
        raise errors.Unavailable("decode worker unreachable")

    async def close(self) -> None:
        pass


def make_core(role: Role = Role.UNIFIED, pusher: Any = None) -> tuple[WorkerCore, FakeEngine]:
    engine = FakeEngine()
    identity = WorkerInfo(
        worker_id="w",
        address="a:1",
        role=role,
        model_id="fake",
        dp_size=1,
        kv_layout=LAYOUT,
        capabilities=CAPABILITIES,
        proto_version=PROTO_VERSION,
        max_model_len=64,
        device="cpu",
    )
    return WorkerCore(engine, identity, pusher or FailingPusher()), engine  # type: ignore[arg-type]


def request(**kw: Any) -> EngineRequest:
    fields: dict[str, Any] = dict(
        request_id="r", prompt_token_ids=(1, 2, 3, 4, 5), sampling=SamplingConfig(max_tokens=4, temperature=0)
    )
    fields.update(kw)
    return EngineRequest(**fields)


def chunk(
    first: int,
    n: int = 1,
    last: bool = False,
    layout: KvLayout | None = LAYOUT,
    generated: int | None = None,
    ticket: str = "t",
) -> IncomingKvChunk:
    return IncomingKvChunk(
        request_id="r",
        transfer_ticket=ticket,
        dp_rank=0,
        layout=layout,
        chunk=KvBlocksChunk(first_block=first, num_blocks=n, data=b"\0" * 8 * n),
        last=last,
        num_tokens=5 if last else 0,
        first_token_id=7 if last else None,
        generated_tokens=generated,
    )


async def stream(*chunks: IncomingKvChunk) -> AsyncIterator[IncomingKvChunk]:
    for c in chunks:
        yield c


async def test_old_prefill_worker_without_count_means_one() -> None:
    core, engine = make_core()
    receipt = await core.receive_kv(stream(chunk(0), chunk(1, last=True)))
    assert receipt.blocks_received == 2 and receipt.bytes_received == 16
    assert ("finish", "t", 5, 7, 1) in engine.calls
    core, engine = make_core()
    await core.receive_kv(stream(chunk(0, last=True, generated=1)))
    assert ("finish", "t", 5, 7, 1) in engine.calls


async def test_broken_transfer_aborts_the_request() -> None:
    core, engine = make_core()
    with pytest.raises(errors.InvalidArgument, match="without a KvChunk marked last"):
        await core.receive_kv(stream(chunk(0)))
    assert ("abort_ticket", "t") in engine.calls
    core, engine = make_core()
    engine.fail_import_at = 1
    with pytest.raises(errors.InvalidArgument):
        await core.receive_kv(stream(chunk(0), chunk(1, last=True)))
    assert ("abort_ticket", "t") in engine.calls


async def test_layout_mismatch_imports_nothing_and_ends_the_waiting_request() -> None:
    """A refused handoff ends the request waiting under its ticket: the prefill worker may have
    answered the gateway already (reply_before_handoff), so nobody else would."""
    core, engine = make_core()
    other = KvLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")
    with pytest.raises(errors.FailedPrecondition, match="layout"):
        await core.receive_kv(stream(chunk(0, layout=other, last=True)))
    assert [c for c in engine.calls if c[0] in ("abort", "abort_ticket", "import", "finish")] == [
        ("abort_ticket", "t")
    ]


async def test_mixed_tickets_and_chunks_after_last_are_rejected() -> None:
    core, _ = make_core()
    with pytest.raises(errors.InvalidArgument, match="same transfer_ticket"):
        await core.receive_kv(stream(chunk(0), chunk(1, ticket="u", last=True)))
    core, _ = make_core()
    with pytest.raises(errors.InvalidArgument, match="after the chunk marked last"):
        await core.receive_kv(stream(chunk(0, last=True), chunk(1, last=True)))
    core, _ = make_core()
    with pytest.raises(errors.InvalidArgument, match="layout"):
        await core.receive_kv(stream(chunk(0, layout=None, last=True)))


async def test_failed_push_releases_the_prefill_blocks() -> None:
    core, engine = make_core(Role.PREFILL)
    target = KvTargetSpec(address="d:1", dp_rank=0, transfer_ticket="t", skip_blocks=1)
    with pytest.raises(errors.Unavailable):
        await core.prefill(PrefillCall(request=request(), kv_target=target, return_token_ids=False))
    assert ("export", "r", 1) in engine.calls
    assert engine.calls[-1] == ("release", "r")
    assert core.num_active == 0


class GatedPusher:
    """A push that waits for `go` (a decode worker READing), then answers or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.go = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = False
        self._fail = fail

    async def push(self, **kwargs: Any) -> KvPushResult:
        list(kwargs["chunks"])
        self.started.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self._fail:
            raise errors.Unavailable("decode worker unreachable")
        return KvPushResult(bytes_sent=8, num_chunks=1, seconds=0.001)


def early_call() -> PrefillCall:
    target = KvTargetSpec(
        address="d:1", dp_rank=0, transfer_ticket="t", skip_blocks=0, reply_before_handoff=True
    )
    return PrefillCall(request=request(), kv_target=target, return_token_ids=True)


@pytest.mark.parametrize("fail", [False, True])
async def test_reply_before_handoff_answers_at_the_first_token_and_releases_after_the_push(
    fail: bool,
) -> None:
    """KvTarget.reply_before_handoff: the reply (first token, no transfer figures) comes while
    the push still waits; the blocks are released only when it ended (answered or failed), and
    a drain waits for it."""
    pusher = GatedPusher(fail=fail)
    core, engine = make_core(Role.PREFILL, pusher)
    result = await core.prefill(early_call())
    assert result.token_ids == (7,) and result.finish_reason is None
    assert (result.kv_bytes_sent, result.kv_transfer_ns, result.kv_transport) == (0, 0, None)
    await asyncio.wait_for(pusher.started.wait(), 5)
    assert ("release", "r") not in engine.calls, "the blocks are held while the decode worker reads"
    assert core.num_active == 1 and not await core.wait_idle(0.01)
    core.begin_drain()
    pusher.go.set()
    assert await core.wait_idle(5)
    assert engine.calls[-1] == ("release", "r") and core.num_active == 0


async def test_abort_during_a_handoff_after_the_reply_cancels_it_and_frees_the_blocks() -> None:
    pusher = GatedPusher()
    core, engine = make_core(Role.PREFILL, pusher)
    await core.prefill(early_call())
    await asyncio.wait_for(pusher.started.wait(), 5)
    assert core.abort("r")
    assert await core.wait_idle(5)
    assert pusher.cancelled
    assert ("abort", "r") in engine.calls and engine.calls[-1] == ("release", "r")


async def test_a_stop_cancels_the_handoffs_still_going_on_and_frees_their_blocks() -> None:
    pusher = GatedPusher()
    core, engine = make_core(Role.PREFILL, pusher)
    await core.prefill(early_call())
    await asyncio.wait_for(pusher.started.wait(), 5)
    await core.cancel_handoffs()
    assert pusher.cancelled and engine.calls[-1] == ("release", "r") and core.num_active == 0


async def test_a_first_token_that_ends_the_request_is_handed_off_before_the_reply() -> None:
    """Nothing to overlap when the request ended at its first token (no KV moves): the empty
    handoff ends before the reply, as without reply_before_handoff."""
    pusher = RecordingPusher()
    core, engine = make_core(Role.PREFILL, pusher)
    original = engine.add_request

    def stopping(request: EngineRequest) -> FakeHandle:
        handle = original(request)
        handle._outputs = [dataclasses.replace(o, finish_reason=FinishReason.STOP) for o in handle._outputs]
        return handle

    engine.add_request = stopping  # type: ignore[method-assign]
    result = await core.prefill(early_call())
    assert result.finish_reason is FinishReason.STOP
    assert pusher.kwargs and engine.calls[-1] == ("release", "r") and core.num_active == 0


async def test_role_gating_and_drain() -> None:
    core, _ = make_core(Role.PREFILL)
    with pytest.raises(errors.FailedPrecondition, match="Decode"):
        async for _ in core.decode(None):  # type: ignore[arg-type]
            pass
    with pytest.raises(errors.FailedPrecondition, match="PushKv"):
        await core.receive_kv(stream())
    core, _ = make_core(Role.UNIFIED)
    core.begin_drain()
    with pytest.raises(errors.Unavailable, match="draining"):
        await core.prefill(PrefillCall(request=request(), kv_target=None, return_token_ids=False))
    assert await core.wait_idle(0)


async def test_proposals_travel_from_prefill_to_the_decode_engine() -> None:
    pusher = RecordingPusher()
    core, engine = make_core(Role.PREFILL, pusher)
    original = engine.add_request

    def with_drafts(request: EngineRequest) -> FakeHandle:
        handle = original(request)
        handle._outputs = [dataclasses.replace(o, draft_token_ids=(8, 9)) for o in handle._outputs]
        return handle

    engine.add_request = with_drafts  # type: ignore[method-assign]
    target = KvTargetSpec(address="d:1", dp_rank=0, transfer_ticket="t", skip_blocks=0)
    await core.prefill(PrefillCall(request=request(), kv_target=target, return_token_ids=False))
    assert pusher.kwargs["draft_token_ids"] == (8, 9)
    assert pusher.kwargs["first_token_id"] == 7
    core, engine = make_core()
    last = dataclasses.replace(chunk(0, last=True, generated=1), draft_token_ids=(8, 9))
    await core.receive_kv(stream(last))
    assert engine.calls[-1] == ("finish", "t", 5, 7, 1, (8, 9))


class FakeNixl:
    """A NIXL agent whose READs of the parts starting at `fail_at` (block indices) fail."""

    def __init__(self, fail_at: tuple[int, ...] = ()) -> None:
        self.fail_at = fail_at

    def read(self, source: NixlSource, offset: int, rank: int, block_ids: list[int], *rest: Any) -> int:
        if source.first_block in self.fail_at:
            raise KvTransferFailed("the peer is gone")
        return 8 * len(block_ids)

    def forget(self, agent_name: str) -> None:
        pass

    def read_path(self, source: NixlSource) -> str:
        return "nixl"


def nixl_part(first: int, n: int, last: bool = False) -> IncomingKvChunk:
    source = NixlSource("p", b"m", 0, 64, 0, "DRAM", tuple(range(first, first + n)), first)
    return dataclasses.replace(
        chunk(first, 0, last=last), chunk=KvBlocksChunk(first, n, b""), nixl_source=source
    )


@pytest.mark.parametrize("fail_at", [(), (1,)])
async def test_nixl_parts_are_read_in_order_and_a_failed_one_recomputes(fail_at: tuple[int, ...]) -> None:
    """KvTarget.nixl_parts (1.10): each NIXL message is READ as it arrives, in order; a failed
    READ (policy recompute) stops the READs, and the request recomputes; mixing NIXL and data
    chunks in one stream is refused (the request aborted)."""
    engine = FakeEngine()
    receiver = KvReceiver(engine, FakeNixl(fail_at), KvLoadFailurePolicy.RECOMPUTE)  # type: ignore[arg-type]
    receipt = await receiver.receive(stream(nixl_part(0, 1), nixl_part(1, 2), nixl_part(3, 1, last=True)))
    reads = [c for c in engine.calls if c[0] == "read"]
    if not fail_at:
        assert reads == [("read", "t", 0, 1), ("read", "t", 1, 2), ("read", "t", 3, 1)]
        assert (receipt.bytes_received, receipt.blocks_received, receipt.recomputing) == (32, 4, False)
        assert engine.calls[-1] == ("finish", "t", 5, 7, 1)
    else:
        assert reads == [("read", "t", 0, 1), ("read", "t", 1, 2)]  # none after the failed one
        assert receipt.recomputing and engine.calls[-1] == ("finish", "t", 5, 7, 1, "recompute")
    engine = FakeEngine()
    receiver = KvReceiver(engine, FakeNixl(), KvLoadFailurePolicy.RECOMPUTE)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument, match="nixl_source all or none"):
        await receiver.receive(stream(nixl_part(0, 1), chunk(1, last=True)))
    assert ("abort_ticket", "t") in engine.calls


@pytest.mark.parametrize("fail_at", [(), (0,)], ids=["read", "failed-read"])
async def test_a_stream_that_breaks_after_its_last_chunk_leaves_the_request_decoding(
    fail_at: tuple[int, ...],
) -> None:
    """The sender dies after its last chunk (a prefill worker killed while waiting for PushKv's
    reply): the engine already has the whole handoff (the KV, or, after a failed READ, the
    order to recompute), so the request decodes on; only a stream cut before its last chunk
    aborts it. Seen in CI as a decode stream that recomputed, sent its first token, then ABORT."""

    async def broken_after(*chunks: IncomingKvChunk) -> AsyncIterator[IncomingKvChunk]:
        for c in chunks:
            yield c
        raise ConnectionResetError("the sender died")

    engine = FakeEngine()
    receiver = KvReceiver(engine, FakeNixl(fail_at), KvLoadFailurePolicy.RECOMPUTE)  # type: ignore[arg-type]
    with pytest.raises(ConnectionResetError):
        await receiver.receive(broken_after(nixl_part(0, 2), nixl_part(2, 1, last=True)))
    assert engine.calls[-1][:2] == ("finish", "t") and ("abort_ticket", "t") not in engine.calls
    engine = FakeEngine()
    receiver = KvReceiver(engine, FakeNixl(), KvLoadFailurePolicy.RECOMPUTE)  # type: ignore[arg-type]
    with pytest.raises(ConnectionResetError):
        await receiver.receive(broken_after(nixl_part(0, 2)))  # cut before the last chunk
    assert ("abort_ticket", "t") in engine.calls and not any(c[0] == "finish" for c in engine.calls)


class LoraEngine(FakeEngine):
    """Loads and unloads adapters as the Engine contract says (lora_adapters follows); `gate`,
    when set, holds a load in its thread until it is set (a slow adapter)."""

    def __init__(self, adapters: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.lora_adapters = adapters
        self.gate: Any = None  # threading.Event

    def load_lora_adapter(self, name: str, path: str) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if name in self.lora_adapters:
            raise errors.AlreadyExists(f"{name!r} is loaded")
        if not path.startswith("/good"):
            raise errors.FailedPrecondition(f"LoRA adapter {name!r} ({path}): no adapter_config.json there")
        self.lora_adapters = (*self.lora_adapters, name)

    def unload_lora_adapter(self, name: str) -> None:
        if name not in self.lora_adapters:
            raise errors.NotFound(f"{name!r} is not loaded")
        self.lora_adapters = tuple(a for a in self.lora_adapters if a != name)


def lora_core(adapters: tuple[str, ...] = ("sql",)) -> tuple[WorkerCore, LoraEngine, list[WorkerInfo]]:
    engine = LoraEngine(adapters)
    identity = WorkerInfo("w", "w:1", Role.UNIFIED, "fake", 1, LAYOUT, lora_adapters=adapters)
    changes: list[WorkerInfo] = []
    core = WorkerCore(
        engine,  # type: ignore[arg-type]
        identity,
        FailingPusher(),  # type: ignore[arg-type]
        lora_paths={"sql": "/good/sql"},
        on_identity_change=changes.append,
    )
    return core, engine, changes


async def test_a_lora_change_updates_the_identity_and_tells_the_registration() -> None:
    core, _, changes = lora_core()
    loaded = await core.load_lora_adapter("chat", "/good/chat")
    assert loaded.lora_adapters == ("sql", "chat") == core.identity.lora_adapters
    assert loaded.path == "/good/chat" and loaded.seconds >= 0
    assert [c.lora_adapters for c in changes] == [("sql", "chat")]
    unloaded = await core.unload_lora_adapter("sql")  # loaded at start: its --lora-modules folder
    assert (unloaded.lora_adapters, unloaded.path) == (("chat",), "/good/sql")
    assert (await core.unload_lora_adapter("chat")).path == "/good/chat"
    assert core.identity.lora_adapters == () and len(changes) == 3


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (("load", "chat", "/bad/chat"), errors.FailedPrecondition),
        (("load", "sql", "/good/sql"), errors.AlreadyExists),
        (("load", "", "/good/x"), errors.InvalidArgument),
        (("load", "x", ""), errors.InvalidArgument),
        (("unload", "nope"), errors.NotFound),
        (("unload", ""), errors.InvalidArgument),
    ],
)
async def test_a_refused_lora_change_changes_nothing(call: tuple[str, ...], error: type[Exception]) -> None:
    core, _, changes = lora_core()
    before = core.identity
    op, *args = call
    with pytest.raises(error):
        await (core.load_lora_adapter(*args) if op == "load" else core.unload_lora_adapter(*args))
    assert core.identity == before and changes == []


async def test_a_load_whose_caller_went_away_still_updates_the_identity() -> None:
    """The engine goes on loading in its thread after the RPC's deadline: the identity (Info,
    the registration) must end up saying what the engine serves."""
    core, engine, changes = lora_core()
    engine.gate = threading.Event()
    task = asyncio.create_task(core.load_lora_adapter("chat", "/good/chat"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.gate.set()
    for _ in range(200):
        if core.identity.lora_adapters == ("sql", "chat"):
            break
        await asyncio.sleep(0.005)
    assert core.identity.lora_adapters == ("sql", "chat") and len(changes) == 1


async def test_a_draining_worker_changes_no_adapter() -> None:
    core, _, _ = lora_core()
    core.begin_drain()
    with pytest.raises(errors.Unavailable, match="draining"):
        await core.load_lora_adapter("chat", "/good/chat")
