"""The NIXL transport's pure parts: the pair's negotiation, block runs, plane descriptors, and
the protobuf round trip of the NIXL fields."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker import convert
from services.worker.engine.api import KvBlocksChunk
from services.worker.kv_descriptors import block_runs, plane_descriptors
from services.worker.messages import KvReceipt, KvTargetSpec, NixlSource
from shared.cluster import NIXL_CAPABILITY, KvLayout, KvTransport, negotiate_kv_transport
from shared.cluster_convert import kv_layout_to_pb
from shared.proto import worker_pb2

LAYOUT = KvLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=2, dtype="float32")


def test_nixl_only_when_both_workers_offer_it() -> None:
    new = ("generated_tokens", NIXL_CAPABILITY)
    old = ("generated_tokens",)
    assert negotiate_kv_transport(new, new) is KvTransport.NIXL
    assert negotiate_kv_transport(new, old) is KvTransport.GRPC_PUSH
    assert negotiate_kv_transport(old, new) is KvTransport.GRPC_PUSH
    assert negotiate_kv_transport((), ()) is KvTransport.GRPC_PUSH


def test_block_runs_merge_what_is_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9], [10, 11, 12, 13]) == [(4, 10, 3), (9, 13, 1)]
    assert block_runs([1, 2], [8, 7]) == [(1, 8, 1), (2, 7, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


def test_plane_descriptors_cover_each_plane_of_each_run() -> None:
    slots, item = 16, 4
    descs = plane_descriptors(1000, slots, LAYOUT, item, 0, [3, 6], [2, 1])
    block_bytes = LAYOUT.block_size * LAYOUT.head_dim * item  # 32
    plane_bytes = slots * LAYOUT.head_dim * item  # 256
    planes = LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads
    assert descs.shape == (planes * 2, 3)
    assert descs.dtype == np.uint64
    # plane p, run 0 starts at block 3 (2 blocks), run 1 at block 6 (1 block)
    assert descs[0].tolist() == [1000 + 3 * block_bytes, 2 * block_bytes, 0]
    assert descs[1].tolist() == [1000 + 6 * block_bytes, block_bytes, 0]
    assert descs[2].tolist() == [1000 + plane_bytes + 3 * block_bytes, 2 * block_bytes, 0]
    total = int(descs[:, 1].sum())
    assert total == planes * 3 * block_bytes  # every byte of the 3 blocks, once


def test_plane_descriptors_of_a_layer_subset_skip_the_other_layers_planes() -> None:
    """A trimmed handoff READs only the full-attention layers' planes (layer 1 here): its
    2 x 3 planes start after layer 0's."""
    slots, item = 16, 4
    descs = plane_descriptors(1000, slots, LAYOUT, item, 0, [3], [2], layers=(1,))
    block_bytes = LAYOUT.block_size * LAYOUT.head_dim * item
    plane_bytes = slots * LAYOUT.head_dim * item
    per_layer = 2 * LAYOUT.num_kv_heads
    assert descs.shape == (per_layer, 3)
    assert descs[:, 0].tolist() == [1000 + (per_layer + p) * plane_bytes + 3 * block_bytes for p in range(6)]
    assert descs[:, 1].tolist() == [2 * block_bytes] * per_layer
    every = plane_descriptors(1000, slots, LAYOUT, item, 0, [3], [2], layers=(0, 1))
    assert every.tolist() == plane_descriptors(1000, slots, LAYOUT, item, 0, [3], [2]).tolist()


def test_trimmed_chunks_carry_their_layers_through_protobuf() -> None:
    target = KvTargetSpec(address="d:1", dp_rank=0, transfer_ticket="t", skip_blocks=0, trim_blocks=5)
    chunk = KvBlocksChunk(first_block=0, num_blocks=5, data=b"\1" * 8, layers=(1, 3))
    pb = convert.kv_chunk_to_pb("r", target, kv_layout_to_pb(LAYOUT), chunk)
    assert list(pb.kv_layers) == [1, 3]
    assert convert.kv_chunk_from_pb(pb).chunk == chunk
    whole = KvBlocksChunk(first_block=5, num_blocks=1, data=b"\1" * 8)
    assert (
        convert.kv_chunk_from_pb(convert.kv_chunk_to_pb("r", target, kv_layout_to_pb(LAYOUT), whole)).chunk
        == whole
    )
    request = worker_pb2.PrefillRequest(
        request_id="r", prompt_token_ids=[1], kv_target=worker_pb2.KvTarget(address="d:1", trim_blocks=5)
    )
    call = convert.prefill_call_from_pb(request)
    assert call.kv_target is not None and call.kv_target.trim_blocks == 5
    request.kv_target.ClearField("trim_blocks")  # an older gateway or decode worker
    call = convert.prefill_call_from_pb(request)
    assert call.kv_target is not None and call.kv_target.trim_blocks == 0


def test_nixl_fields_round_trip() -> None:
    source = NixlSource(
        agent_name="pdserve-a",
        agent_metadata=b"\x01\x02",
        pool_address=1 << 40,
        pool_slots=4096,
        device_id=0,
        mem_type="DRAM",
        block_ids=(7, 8, 9),
        first_block=2,
    )
    target = KvTargetSpec("d:1", 0, "0-t", 2, KvTransport.NIXL)
    pb = convert.kv_chunk_to_pb(
        "r",
        target,
        kv_layout_to_pb(LAYOUT),
        KvBlocksChunk(first_block=2, num_blocks=3, data=b""),
        last=(40, 5, 1),
        nixl_source=source,
    )
    back = convert.kv_chunk_from_pb(worker_pb2.KvChunk.FromString(pb.SerializeToString()))
    assert back.nixl_source == source
    assert back.last and back.first_token_id == 5
    plain = convert.kv_chunk_from_pb(worker_pb2.KvChunk(request_id="r", last=True))
    assert plain.nixl_source is None

    request = worker_pb2.PrefillRequest(
        request_id="r",
        kv_target=worker_pb2.KvTarget(address="d:1", kv_transport=worker_pb2.KV_TRANSPORT_NIXL),
    )
    call = convert.prefill_call_from_pb(request)
    assert call.kv_target is not None and call.kv_target.transport is KvTransport.NIXL
    request.kv_target.ClearField("kv_transport")  # an older gateway: the gRPC push
    call = convert.prefill_call_from_pb(request)
    assert call.kv_target is not None and call.kv_target.transport is KvTransport.GRPC_PUSH

    receipt = convert.kv_receipt_to_pb(KvReceipt(bytes_received=0, blocks_received=0, recomputing=True))
    assert receipt.HasField("recomputing") and not receipt.HasField("kv_read_ns")
    receipt = convert.kv_receipt_to_pb(KvReceipt(bytes_received=10, blocks_received=1, read_ns=5))
    assert receipt.kv_read_ns == 5 and not receipt.HasField("recomputing")
