"""The NIXL transport's pure parts: the pair's negotiation, block runs, plane descriptors, the
protobuf round trip of the NIXL fields, and the UCX configuration an agent sets on GPUs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from services.worker import convert
from services.worker.engine.api import KvBlocksChunk
from services.worker.kv_descriptors import block_runs, plane_descriptors
from services.worker.kv_nixl import UCX_CUDA_DEFAULTS, NixlKvAgent, ucx_cuda_defaults
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


def test_ucx_cuda_defaults_fill_only_what_the_operator_left_unset() -> None:
    """On GPUs the agent turns UCX's GET over CUDA IPC on (UCX turns it off without NVLink, and
    a READ of VRAM then crawls over TCP on loopback); an operator's own value stays."""
    env: dict[str, str] = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}
    assert ucx_cuda_defaults(env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert env == {"UCX_TLS": "cuda_ipc,cuda_copy,tcp", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    operator = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}
    assert ucx_cuda_defaults(operator) == {}
    assert operator == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}


class _FakeNixl:
    """Records the UCX variables in the environment when the agent is made (when UCX reads
    them)."""

    def __init__(self) -> None:
        self.env_at_agent: dict[str, str] = {}

    def nixl_agent_config(self, **kwargs: object) -> dict[str, object]:
        return kwargs

    def nixl_agent(self, name: str, config: object) -> _FakeNixl:
        self.env_at_agent = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        return self

    def register_memory(self, pool: torch.Tensor) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"meta"


def _pool(device: str) -> torch.Tensor:
    return torch.zeros(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 16, LAYOUT.head_dim, device=device)


def test_an_agent_over_host_memory_leaves_ucx_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in UCX_CUDA_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    api = _FakeNixl()
    NixlKvAgent(api, [_pool("cpu")], LAYOUT)
    assert not set(UCX_CUDA_DEFAULTS) & set(api.env_at_agent)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_agent_over_vram_turns_get_over_cuda_ipc_on_before_ucx_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in UCX_CUDA_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    api = _FakeNixl()
    NixlKvAgent(api, [_pool("cuda")], LAYOUT)
    assert api.env_at_agent["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
