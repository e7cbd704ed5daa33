"""KV handoff within one host on GPUs: the decode worker maps the prefill worker's KV pool through
CUDA IPC and copies the request's blocks device to device, in place of a NIXL READ (issue 27).

Why not NIXL here. NIXL's READ is a UCX GET, and UCX picks its lanes for one-sided operations from
transports that offer short and buffered RMA; CUDA IPC offers only zero-copy puts and gets, which
UCX uses for RMA only beside a native RMA lane (InfiniBand / RoCE). On a host without one, a READ
of VRAM is emulated over TCP through host buffers: measured on one H200 (benchmarks/results/
nixl-probe-h200.txt), UCX's protocol table said "software emulation | tcp/lo" and 256 MiB took
506-576 ms (0.43 GiB/s), whatever the thread, the progress mode or UCX_CUDA_IPC_ENABLE_GET_ZCOPY.
Every single-GPU machine and every node without RDMA NICs is such a host. A device-to-device copy
of the same bytes is bounded by HBM bandwidth (under a millisecond on that GPU). NIXL stays the
path between hosts and wherever the mapping cannot be opened.

How. The prefill worker shares each CUDA pool once (torch's own CUDA IPC sharing, the one
torch.multiprocessing uses: `UntypedStorage._share_cuda_`), and the share travels with the NIXL
source of every handoff (worker.proto CudaIpcShare, 1.19) together with the host's boot id. A
decode worker on the same host (same boot id) whose pools are on a GPU opens the share once per
peer pool (`UntypedStorage._new_shared_cuda`; cudaIpcOpenMemHandle underneath) and keeps the
mapping while the peer is known. A share it cannot open (another process on a GPU it cannot see,
a container without the host's IPC namespace, the same process) is remembered as such and that
peer's handoffs go over NIXL, logged once.

Copy. `copy_blocks` copies whole blocks between two pools of the same layout ([layers, 2, kv_heads,
slots, head_dim]), one strided copy per run of blocks consecutive on both sides (a request's blocks
are mostly one run), on a stream of its own, and waits for it before returning, so the prefill
side may free its blocks as soon as the PushKv call ends and the decode step that reads the
blocks is launched after they landed. The prefill worker's kernels that wrote them have finished
before it names them (its first token is on the host, or its progress cue waited for its step).
It is device-agnostic: on a CPU it copies between tensors the same way (the unit tests).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from services.worker.kv_descriptors import block_runs
from services.worker.messages import CudaIpcShare
from shared.cluster import KvLayout

log = structlog.get_logger(__name__)

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
IDLE_UNMAP_S = 600.0  # a peer pool not read for this long is unmapped (seconds)


@functools.cache
def host_id() -> str:
    """This host's boot id: equal for every process on the host (containers included), new at
    every boot; '' where the kernel does not say (then no share is ever opened)."""
    try:
        return _BOOT_ID.read_text(encoding="ascii").strip()
    except OSError:
        return ""


def share(pool: torch.Tensor) -> CudaIpcShare | None:
    """The pool's CUDA IPC share; None for a pool not on a GPU, or when sharing fails (logged)."""
    if pool.device.type != "cuda" or not host_id():
        return None
    if pool.storage_offset() != 0 or not pool.is_contiguous():  # a peer maps whole storages
        log.warning("cuda_ipc_not_shared", reason="the KV pool is not a whole contiguous storage")
        return None
    try:
        device, handle, size, offset, counter, counter_offset, event, sync = (
            pool.untyped_storage()._share_cuda_()
        )
    except Exception as exc:  # no IPC on this device or driver: NIXL READs then
        log.warning("cuda_ipc_share_failed", error=f"{type(exc).__name__}: {exc}")
        return None
    return CudaIpcShare(
        host_id=host_id(),
        device_index=int(device),
        mem_handle=bytes(handle),
        storage_bytes=int(size),
        storage_offset=int(offset),
        ref_counter_handle=bytes(counter or b""),
        ref_counter_offset=int(counter_offset or 0),
        event_handle=bytes(event or b""),
        event_sync_required=bool(sync),
    )


def open_share(
    s: CudaIpcShare, device: torch.device, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The peer's pool mapped into this process on `device` (raises where CUDA IPC cannot open it)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(),
        s.mem_handle,
        s.storage_bytes,
        s.storage_offset,
        s.ref_counter_handle or None,
        s.ref_counter_offset,
        s.event_handle or None,
        s.event_sync_required,
    )
    return view_pool(storage, s.storage_bytes, device, shape, dtype)


def view_pool(
    storage: torch.UntypedStorage,
    nbytes: int,
    device: torch.device,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """A contiguous pool of `shape` over `storage` (ValueError when it holds less)."""
    numel = 1
    for n in shape:
        numel *= n
    if numel * torch.empty((), dtype=dtype).element_size() > nbytes:
        raise ValueError(f"the shared pool holds {nbytes} bytes, less than a pool of {list(shape)}")
    stride = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, stride)


Opener = Callable[[CudaIpcShare, torch.device, tuple[int, ...], torch.dtype], torch.Tensor]


class PeerPools:
    """The peer pools this worker mapped (by share), and the shares it could not open. Thread-safe."""

    def __init__(
        self, layout: KvLayout, device: torch.device, dtype: torch.dtype, opener: Opener = open_share
    ) -> None:
        self._layout = layout
        self._device = device
        self._dtype = dtype
        self._opener = opener
        self._lock = threading.Lock()
        self._mapped: dict[tuple[str, bytes, int], torch.Tensor] = {}
        self._refused: set[tuple[str, bytes, int]] = set()
        self._by_peer: dict[str, set[tuple[str, bytes, int]]] = {}  # agent name -> its shares
        self._used: dict[tuple[str, bytes, int], float] = {}  # share -> last use (monotonic s)
        # the copies' own stream (CUDA), made on first use: a copy does not queue behind the
        # decode step running on the default stream
        self._stream: Any = None

    def get(self, peer: str, s: CudaIpcShare | None, pool_slots: int) -> torch.Tensor | None:
        """The peer's pool mapped here, or None: no share, another host, not openable here."""
        if s is None or not s.host_id or s.host_id != host_id():
            return None
        key = s.key()
        with self._lock:
            now = time.monotonic()
            self._unmap_idle(now, keep=key)
            pool = self._mapped.get(key)
            if pool is not None:
                self._used[key] = now
            if pool is not None or key in self._refused:
                return pool
            shape = (self._layout.num_layers, 2, self._layout.num_kv_heads, pool_slots, self._layout.head_dim)
            try:
                if self._device.type == "cuda":
                    torch.cuda.set_device(self._device)
                pool = self._opener(s, self._device, shape, self._dtype)
            except Exception as exc:
                self._refused.add(key)
                log.warning(
                    "cuda_ipc_open_failed", peer=peer, error=f"{type(exc).__name__}: {exc}", fallback="nixl"
                )
                return None
            self._mapped[key] = pool
            self._used[key] = now
            self._by_peer.setdefault(peer, set()).add(key)
            log.info("cuda_ipc_mapped", peer=peer, bytes=s.storage_bytes)
            return pool

    def forget(self, peer: str) -> None:
        """Unmap a peer's pools (it failed or restarted; a restarted peer shares anew)."""
        with self._lock:
            for key in self._by_peer.pop(peer, set()):
                self._mapped.pop(key, None)
                self._used.pop(key, None)

    def _unmap_idle(self, now: float, keep: tuple[str, bytes, int]) -> None:
        """(Under the lock.) Unmap pools not read for IDLE_UNMAP_S: a prefill worker that went
        away (scaled down, restarted under another share) is never read again, and its mapping
        would otherwise stay for the life of this worker; one still there is mapped again on
        its next read."""
        for key in [k for k, t in self._used.items() if now - t > IDLE_UNMAP_S and k != keep]:
            self._mapped.pop(key, None)
            self._used.pop(key, None)
            for shares in self._by_peer.values():
                shares.discard(key)

    def num_mapped(self) -> int:
        with self._lock:
            return len(self._mapped)

    def stream(self) -> Any:
        if self._stream is None and self._device.type == "cuda":
            self._stream = torch.cuda.Stream(self._device)
        return self._stream


def copy_blocks(
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    block_size: int,
    src_blocks: list[int],
    dst_blocks: list[int],
    num_trimmed: int = 0,
    layers: tuple[int, ...] = (),
    stream: Any = None,
) -> int:
    """Copy blocks src_blocks of src_pool into blocks dst_blocks of dst_pool (same layout), the
    first num_trimmed of them only in `layers` (a trimmed handoff: engine/kv_trim.py), on
    `stream` (CUDA; None: the current one); returns the bytes copied, once they are in place."""
    num_trimmed = min(num_trimmed, len(dst_blocks)) if layers else 0
    nbytes = 0
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for part_src, part_dst, part_layers in (
            (src_blocks[:num_trimmed], dst_blocks[:num_trimmed], layers),
            (src_blocks[num_trimmed:], dst_blocks[num_trimmed:], None),
        ):
            for s0, d0, n in block_runs(part_src, part_dst):
                src = src_pool[..., s0 * block_size : (s0 + n) * block_size, :]
                dst = dst_pool[..., d0 * block_size : (d0 + n) * block_size, :]
                if part_layers is not None:
                    for layer in part_layers:
                        dst[layer].copy_(src[layer], non_blocking=True)
                        nbytes += src[layer].numel() * src.element_size()
                else:
                    dst.copy_(src, non_blocking=True)
                    nbytes += src.numel() * src.element_size()
    if dst_pool.device.type == "cuda":
        (stream or torch.cuda.current_stream(dst_pool.device)).synchronize()
    return nbytes
