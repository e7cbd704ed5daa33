"""Same-host KV handoff through CUDA IPC (kv_cuda_ipc.py): the block copy (device-agnostic, run
here on the CPU), the peer pools a decode worker maps, the share's wire form; and, on a GPU, a
pool shared by another process, mapped and copied from."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.worker import convert, kv_cuda_ipc
from services.worker.kv_cuda_ipc import PeerPools, copy_blocks, host_id, view_pool
from services.worker.kv_descriptors import block_runs, plane_descriptors
from services.worker.messages import CudaIpcShare, NixlSource
from shared.cluster import KvLayout

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype="float32")
SLOTS = 16 * LAYOUT.block_size  # 16 blocks per pool


def _pool(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, SLOTS, LAYOUT.head_dim)
    return torch.randn(shape, generator=g)


def _blocks(pool: torch.Tensor, block: int) -> torch.Tensor:
    bs = LAYOUT.block_size
    return pool[..., block * bs : (block + 1) * bs, :]


def _nixl_bytes(src: list[int], dst: list[int], layers: tuple[int, ...] | None) -> int:
    """What NIXL's descriptors for the same blocks would move (kv_nixl.read's byte count)."""
    runs = block_runs(src, dst)
    if not runs:
        return 0
    descs = plane_descriptors(0, SLOTS, LAYOUT, 4, 0, [r[1] for r in runs], [r[2] for r in runs], layers)
    return int(np.asarray(descs)[:, 1].sum())


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([3, 4, 5, 6], [9, 10, 11, 12]),  # one run on both sides
        ([3, 4, 8, 1], [2, 3, 4, 5]),  # runs broken on the source side
        ([7], [0]),
        ([], []),
    ],
)
def test_blocks_land_where_the_reader_reserved_them_and_nothing_else_moves(
    src: list[int], dst: list[int]
) -> None:
    remote, local = _pool(1), _pool(2)
    before = local.clone()
    nbytes = copy_blocks(remote, local, LAYOUT.block_size, src, dst)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_blocks(local, d), _blocks(remote, s))
    untouched = [b for b in range(16) if b not in dst]
    for b in untouched:
        assert torch.equal(_blocks(local, b), _blocks(before, b))
    assert nbytes == _nixl_bytes(src, dst, None)


def test_a_trimmed_handoff_copies_its_first_blocks_in_the_named_layers_only() -> None:
    remote, local = _pool(3), _pool(4)
    before = local.clone()
    src, dst, layers = [5, 6, 7], [1, 2, 3], (0, 2)
    nbytes = copy_blocks(remote, local, LAYOUT.block_size, src, dst, num_trimmed=2, layers=layers)
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        for layer in range(LAYOUT.num_layers):
            copied = i >= 2 or layer in layers
            want = _blocks(remote, s)[layer] if copied else _blocks(before, d)[layer]
            assert torch.equal(_blocks(local, d)[layer], want), (i, layer)
    assert nbytes == _nixl_bytes(src[:2], dst[:2], layers) + _nixl_bytes(src[2:], dst[2:], None)


def test_a_pool_view_over_a_storage_sees_its_bytes_and_refuses_a_short_one() -> None:
    pool = _pool(5)
    storage = pool.untyped_storage()
    shape = tuple(pool.shape)
    view = view_pool(storage, storage.nbytes(), pool.device, shape, pool.dtype)
    assert torch.equal(view, pool)
    view[0, 0, 0, 0, 0] = 42.0  # the same memory
    assert pool[0, 0, 0, 0, 0] == 42.0
    bigger = (*shape[:3], shape[3] * 2, shape[4])
    with pytest.raises(ValueError, match="less than a pool"):
        view_pool(storage, storage.nbytes(), pool.device, bigger, pool.dtype)


def _share(handle: bytes = b"h" * 64, host: str | None = None) -> CudaIpcShare:
    return CudaIpcShare(
        host_id=host_id() if host is None else host,
        device_index=0,
        mem_handle=handle,
        storage_bytes=_pool(0).untyped_storage().nbytes(),
        storage_offset=0,
        ref_counter_handle=b"/torch_1_2",
        ref_counter_offset=3,
        event_handle=b"e" * 64,
        event_sync_required=True,
    )


class _Opener:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(
        self, s: CudaIpcShare, device: torch.device, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        self.calls += 1
        if self.fail:
            raise RuntimeError("cudaErrorInvalidContext")
        assert shape == (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, SLOTS, LAYOUT.head_dim)
        return _pool(6)


@pytest.mark.skipif(not host_id(), reason="the kernel gives no boot id")
def test_a_peer_pool_is_mapped_once_and_only_from_this_host() -> None:
    opener = _Opener()
    peers = PeerPools(LAYOUT, torch.device("cpu"), torch.float32, opener)
    assert peers.get("p", None, SLOTS) is None  # no share: NIXL
    assert peers.get("p", _share(host="another-host"), SLOTS) is None
    assert opener.calls == 0
    first = peers.get("p", _share(), SLOTS)
    assert first is not None and peers.get("p", _share(), SLOTS) is first
    assert opener.calls == 1 and peers.num_mapped() == 1
    peers.forget("p")  # it failed or restarted: mapped again when it shares again
    assert peers.num_mapped() == 0
    assert peers.get("p", _share(), SLOTS) is not None and opener.calls == 2


@pytest.mark.skipif(not host_id(), reason="the kernel gives no boot id")
def test_a_peer_pool_not_read_for_a_while_is_unmapped_and_mapped_again_when_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(kv_cuda_ipc.time, "monotonic", lambda: clock[0])
    opener = _Opener()
    peers = PeerPools(LAYOUT, torch.device("cpu"), torch.float32, opener)
    gone, still = _share(handle=b"g" * 64), _share(handle=b"s" * 64)
    assert peers.get("gone", gone, SLOTS) is not None and peers.get("still", still, SLOTS) is not None
    clock[0] += kv_cuda_ipc.IDLE_UNMAP_S / 2
    assert peers.get("still", still, SLOTS) is not None  # read: its clock starts again
    clock[0] += kv_cuda_ipc.IDLE_UNMAP_S / 2 + 1
    assert peers.get("still", still, SLOTS) is not None
    assert peers.num_mapped() == 1 and opener.calls == 2  # the idle one went; the other stayed
    assert peers.get("gone", gone, SLOTS) is not None and opener.calls == 3  # back when read


@pytest.mark.skipif(not host_id(), reason="the kernel gives no boot id")
def test_a_share_that_does_not_open_is_not_tried_again() -> None:
    opener = _Opener(fail=True)
    peers = PeerPools(LAYOUT, torch.device("cpu"), torch.float32, opener)
    assert peers.get("p", _share(), SLOTS) is None
    assert peers.get("p", _share(), SLOTS) is None
    assert opener.calls == 1
    assert peers.get("q", _share(handle=b"x" * 64), SLOTS) is None  # another share is tried
    assert opener.calls == 2


def test_the_share_crosses_the_wire_whole_and_an_older_source_has_none() -> None:
    source = NixlSource("agent", b"meta", 1 << 40, SLOTS, 0, "VRAM", (1, 2, 3), 4, cuda_ipc=_share(host="h"))
    pb = convert.nixl_source_to_pb(source)
    assert convert.nixl_source_from_pb(pb) == source
    pb.ClearField("cuda_ipc")  # what a 1.18 prefill worker sends
    assert convert.nixl_source_from_pb(pb) == dataclasses.replace(source, cuda_ipc=None)


def test_a_cpu_pool_is_not_shared() -> None:
    assert kv_cuda_ipc.share(_pool(0)) is None


_PRODUCER = textwrap.dedent(
    """
    import base64, dataclasses, json, sys
    import torch
    from services.worker import kv_cuda_ipc
    pool = torch.arange(SHAPE_NUMEL, dtype=torch.bfloat16, device="cuda").view(SHAPE) / 64
    s = kv_cuda_ipc.share(pool)
    values = dataclasses.asdict(s).items()
    fields = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in values}
    print(json.dumps(fields), flush=True)
    sys.stdin.readline()  # keep the pool alive until the reader is done
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pool_shared_by_another_process_is_copied_from_device_to_device() -> None:
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, SLOTS, LAYOUT.head_dim)
    numel = int(np.prod(shape))
    code = _PRODUCER.replace("SHAPE_NUMEL", str(numel)).replace("SHAPE", str(shape))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    ) as producer:
        assert producer.stdout is not None and producer.stdin is not None
        fields = json.loads(producer.stdout.readline())
        raw = {f.name for f in dataclasses.fields(CudaIpcShare) if f.type in ("bytes", bytes)}
        values: dict[str, Any] = {k: base64.b64decode(v) if k in raw else v for k, v in fields.items()}
        s = CudaIpcShare(**values)
        peers = PeerPools(LAYOUT, torch.device("cuda", 0), torch.bfloat16)
        remote = peers.get("producer", s, SLOTS)
        assert remote is not None, "the share did not open"
        local = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        src, dst = [3, 4, 5, 9], [0, 1, 2, 7]
        nbytes = copy_blocks(remote, local, LAYOUT.block_size, src, dst, stream=peers.stream())
        want = torch.arange(numel, dtype=torch.bfloat16, device="cuda").view(shape) / 64
        for s_block, d_block in zip(src, dst, strict=True):
            assert torch.equal(_blocks(local, d_block), _blocks(want, s_block))
        assert (
            nbytes
            == 4 * LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.block_size * LAYOUT.head_dim * 2
        )
        producer.stdin.write("done\n")
        producer.stdin.flush()
        assert producer.wait(timeout=60) == 0
