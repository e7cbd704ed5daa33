"""The prefill side of NIXL in parts (kv_send_nixl.EarlyNixlPush) with fakes for the engine, the
agent and the PushKv stream: what each message names."""

from __future__ import annotations

import asyncio

from services.worker.kv_send_nixl import EarlyNixlPush
from services.worker.messages import KvHandoff, KvTargetSpec, NixlSource
from shared.cluster import KvLayout, KvTransport
from shared.cluster_convert import kv_layout_to_pb
from shared.proto import worker_pb2

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, dtype="float32")


class FakeEngine:
    """A prefill whose block table and preemption count the test sets."""

    def __init__(self) -> None:
        self.block_ids = list(range(10, 20))
        self.preemptions = 0

    def request_preemptions(self, request_id: str) -> int:
        return self.preemptions

    def export_block_ids(self, request_id: str, skip: int, end: int | None = None) -> tuple[int, list[int]]:
        return 0, self.block_ids[skip:end]


class FakeAgent:
    progress_thread = False

    def source(self, dp_rank: int, block_ids: list[int], first_block: int) -> NixlSource:
        return NixlSource("prefill", b"meta", 4096, 64, 0, "DRAM", tuple(block_ids), first_block)

    def progress(self) -> None:
        pass


class FakeStream:
    layout_pb = kv_layout_to_pb(LAYOUT)

    def __init__(self) -> None:
        self.sent: list[worker_pb2.KvChunk] = []
        self.closed = False

    @property
    def num_messages(self) -> int:
        return len(self.sent)

    def done(self) -> bool:
        return self.closed

    def put(self, pb: worker_pb2.KvChunk) -> None:
        self.sent.append(pb)

    async def close(self, pb: worker_pb2.KvChunk) -> worker_pb2.PushKvResponse:
        self.sent.append(pb)
        self.closed = True
        return worker_pb2.PushKvResponse()

    def cancel(self) -> None:
        self.closed = True


def _named(pb: worker_pb2.KvChunk) -> tuple[int, list[int]]:
    return pb.nixl_source.first_block, list(pb.nixl_source.block_ids)


async def _handoff(preempt_between: bool) -> list[tuple[int, list[int]]]:
    engine, stream = FakeEngine(), FakeStream()
    target = KvTargetSpec("decode:1", 0, "t1", 1, KvTransport.NIXL, nixl_parts=True)
    push = EarlyNixlPush(engine, FakeAgent(), stream, target, 4, "r1")  # type: ignore[arg-type]
    push.ready(12)  # blocks 1, 2 computed (block 0 the decode worker has)
    if preempt_between:
        # freed and computed again into the same blocks: a READ of them meanwhile may have
        # copied another request's data
        engine.preemptions += 1
    push.ready(24)
    await push.finish(KvHandoff("r1", LAYOUT, 40, 7, 1))
    await asyncio.sleep(0)
    return [_named(pb) for pb in stream.sent]


async def test_each_part_names_the_new_blocks_and_the_last_the_rest() -> None:
    assert await _handoff(preempt_between=False) == [(1, [11, 12]), (3, [13, 14, 15]), (6, [16, 17, 18, 19])]


async def test_after_a_preemption_the_last_message_names_every_block_again() -> None:
    sent = await _handoff(preempt_between=True)
    assert sent[-1] == (1, list(range(11, 20)))  # READ over the parts, after them
