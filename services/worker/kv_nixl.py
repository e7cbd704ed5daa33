"""The worker's NIXL agent: its KV pools registered once at start; READs of a peer's blocks.

NIXL (NVIDIA's inference transfer library; UCX underneath: shared memory or TCP between processes
on a CPU, CUDA IPC / NVLink / RDMA on GPUs) moves bytes between registered memory regions of two
agents. A worker registers every rank's KV pool with its one agent at start-up; the agent's
metadata (~0.5 KiB) and the request's pool block ids travel with the handoff message (PushKv's
single KvChunk), and the decode worker READs the blocks straight into the blocks it reserved:
one copy, no serialization, no bounce through a message (the pattern of vLLM's NixlConnector).
In parts (KvTarget.nixl_parts, 1.10, both workers advertising "kv_nixl_parts"): a prefill in
several chunks sends one such KvChunk per chunk, naming its complete blocks, as soon as it is
computed, the last marked last; the decode worker READs each as it arrives, one at a time, in
order (kv_receive.py), so the READs overlap the rest of the prefill (kv_send_nixl.EarlyNixlPush).

Descriptors. The pool is [layers, 2 (K, V), kv_heads, slots, head_dim], so a block is not one
region: each (layer, K/V, head) plane holds its block_size x head_dim rows contiguously, planes
are a pool's slots apart. A READ is therefore one descriptor per plane per *run* of blocks that
are consecutive on both sides (fresh pools hand out consecutive blocks, so a request's blocks are
mostly one run): 180 descriptors for SmolLM2 (30 layers x 2 x 3 heads) when the run is whole.
Measured on a 2-core CPU (one process, two agents, 512 tokens = 22.5 MiB fp32, a loaded machine):
180 descriptors of 128 KiB took 22-70 ms, 5,760 descriptors of 4 KiB (one per plane per block)
105-200 ms. The UCX backend of nixl-cu13 1.5.1 ignores the count of a strided (N x 5)
descriptor list (only the first element moved), so strided descriptors are not used. On a
sliding-window model the decode side READs the blocks behind every window in the full-attention
layers' planes only, and blocks it released not at all (engine/kv_trim.py); one transfer either
way.

Progress. NIXL's own progress thread busy-polls (its Python API fixes the delay at 0): measured,
an idle agent burnt ~0.5 of a core, which on a 2-core worker host is most of a prefill's share.
So the agent runs without it (`--kv-nixl-progress loop`, the default): the decode side
progresses while it waits for its READ
(check_xfer_state), and the prefill side, whose memory is read, calls `progress` about every
millisecond while its handoff is in flight (kv_send_nixl.py; in parts, from the first message
until the PushKv call ends). Without the target's progress a READ never completes, over shared
memory (CMA) or TCP alike. Measured between two processes on this
2-core CPU (22.5 MiB, 180 descriptors): 5.6 ms this way, 13 ms with the spinning thread.
`--kv-nixl-progress thread` turns it on (for measurements: on CUDA NIXL's UCX plugin runs that
thread with no CUDA context, and ai-dynamo/nixl issue 2102 reports segfaults in cuEventQuery
from it).

CUDA context. UCX's CUDA transports work in the calling thread's current context, and a thread
torch never set a device in has none: UCX then cannot use CUDA IPC and moves VRAM through host
buffers (vLLM found the same, vllm-project/vllm PR 36475). On an H200 the 8B shape's
2,048-token handoff (256 MiB) took 616 ms, 0.41 GiB/s, with the agent made on the event loop
and READs run in pool threads, neither of which had touched CUDA. So the agent makes the pools'
GPU current in every thread that calls into it (`_bind`); benchmarks/nixl_probe.py times a
READ from the pool's thread and from a fresh one.

GET over CUDA IPC. Measured on one H200 with that fix in (benchmarks/nixl_probe.py,
UCX_PROTO_INFO=y): still 506-576 ms for 256 MiB from any thread and progress mode, and UCX's
protocol table named the reason: "remote memory read by ucp_get*(multi) into cuda/GPU0 from
cuda/dev[1] | 0..inf | software emulation | tcp/lo". UCX turns CUDA IPC's get_zcopy off on GPUs
without active NVLink (openucx/ucx PR 7566: concurrent reads were slower than puts on such
platforms), which leaves a READ of VRAM nothing but TCP over loopback: every single-GPU node and
every PCIe-only one. A NIXL READ is a GET, so the agent turns it back on
(UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on, as llm-d and vLLM's same-node setups do; NIXL PR 2208 does the
same in its plugin) where its pools are on a GPU and the operator has not set the variable. That
is UCX's own configuration, read by UCX when the agent is made (`ucx_cuda_defaults`).

Timeouts. A READ cannot be cancelled: measured with UCX, the bytes of a READ whose handle was
released (even with its peer's metadata removed) still land once the peer progresses. A READ that
times out is therefore kept (KvTransferUnsettled) and watched by a reaper thread until
check_xfer_state says it ended; only then is the handle released and the engine told, which
keeps the target blocks quarantined until that moment (engine/handoff.py). A killed peer ends it
at once (NIXL raises NIXL_ERR_REMOTE_DISCONNECT).

No grpc here; `nixl_cu13` is imported lazily, so a worker without it runs with the gRPC push.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np
import structlog
import torch

from services.worker import kv_cuda_ipc
from services.worker.engine.api import KvReadUnsettled
from services.worker.kv_descriptors import block_runs, plane_descriptors
from services.worker.messages import NixlSource
from shared import errors
from shared.cluster import KvLayout

log = structlog.get_logger(__name__)

_POLL_S = 50e-6  # between checks of a READ in flight (seconds)
# between checks of timed-out READs still in flight (seconds): from the first to the longest
_REAP_FIRST_S, _REAP_MAX_S = 0.002, 0.1


class KvTransferFailed(errors.Unavailable):
    """A NIXL READ failed or timed out (the peer died, its memory is gone, it was too slow)."""


class KvTransferUnsettled(KvTransferFailed, KvReadUnsettled):
    """A NIXL READ timed out while still in flight: it may yet land in its target blocks (the
    engine quarantines them until `on_settled` runs, when the agent saw the transfer end)."""

    def __init__(self, message: str, pending: _PendingRead) -> None:
        super().__init__(message)
        self._pending = pending

    def on_settled(self, callback: Callable[[], None]) -> None:
        self._pending.on_settled(callback)


class _PendingRead:
    """A timed-out READ's handle, kept until the transfer ends (then released), and what to run
    then (the engine's release of the quarantined blocks)."""

    def __init__(self, handle: Any, peer: str) -> None:
        self.handle = handle
        self.peer = peer
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._settled = False

    def on_settled(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._settled:
                self._callbacks.append(callback)
                return
        callback()

    def settle(self) -> None:
        with self._lock:
            self._settled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one failing callback must not keep the others' blocks
                log.exception("nixl_settle_callback_failed", peer=self.peer)


# UCX's configuration for agents whose memory is on a GPU (see "GET over CUDA IPC" above);
# UCX reads its UCX_* variables when an agent's context is made
UCX_CUDA_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def ucx_cuda_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set UCX_CUDA_DEFAULTS in the process environment (where UCX reads its configuration)
    except those the operator set; returns what was set."""
    env = os.environ if environ is None else environ
    applied = {k: v for k, v in UCX_CUDA_DEFAULTS.items() if k not in env}
    env.update(applied)
    return applied


def load_nixl() -> Any | None:
    """The nixl_cu13 API module, or None where it does not load (not installed, no UCX)."""
    try:
        from nixl_cu13 import _api  # optional dependency, loaded on demand
    except Exception as exc:  # ImportError, or a missing shared library inside it
        log.info("nixl_unavailable", error=f"{type(exc).__name__}: {exc}")
        return None
    return _api


class NixlKvAgent:
    """One per worker process. Thread-safe: calls are serialized by one lock (READs are run from
    worker threads; one at a time keeps the agent's use simple and the link busy)."""

    def __init__(
        self,
        api: Any,
        pools: list[torch.Tensor],
        layout: KvLayout,
        progress_thread: bool = False,
        direct: bool = True,
    ) -> None:
        """direct: GPU pools are shared and peers' mapped through CUDA IPC (kv_cuda_ipc.py)."""
        self.name = f"pdserve-{uuid.uuid4().hex}"  # unique per process: a restarted peer is new
        self._api = api
        # with NIXL's own progress thread, `progress` has nothing to do
        self.progress_thread = progress_thread
        # the GPU of the pools, made current in every thread that calls into the agent (UCX's
        # CUDA transports work in the calling thread's context; a worker creates its agent on
        # the event loop and READs from pool threads, where torch may never have set a device)
        self._cuda = next((p.device for p in pools if p.device.type == "cuda"), None)
        self._bind()
        # before the agent: UCX reads its configuration when the agent's context is made
        ucx = ucx_cuda_defaults() if self._cuda is not None else {}
        config = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread)
        self._agent = api.nixl_agent(self.name, config)
        self._pools = pools
        self._layout = layout
        self._lock = threading.Lock()
        self._remotes: set[str] = set()
        # timed-out READs still in flight, and peers whose metadata goes once theirs settle
        # (removing a peer does not stop its transfers: measured, the bytes still land)
        self._unsettled: list[_PendingRead] = []
        self._forget_later: set[str] = set()
        self._reaper: threading.Thread | None = None
        for pool in pools:
            if not pool.is_contiguous():
                raise ValueError("a KV pool registered with NIXL must be contiguous")
            self._agent.register_memory(pool)
        self._metadata: bytes = self._agent.get_agent_metadata()
        # GPU pools: shared through CUDA IPC for decode workers on this host, and the peers'
        # pools this worker maps to copy from (kv_cuda_ipc.py; NIXL READs elsewhere)
        self._shares = [kv_cuda_ipc.share(p) if direct else None for p in pools]
        self._peers = (
            kv_cuda_ipc.PeerPools(layout, self._cuda, pools[0].dtype)
            if direct and self._cuda is not None
            else None
        )
        log.info(
            "nixl_ready",
            agent=self.name,
            pools=len(pools),
            pool_bytes=sum(_nbytes(p) for p in pools),
            progress_thread=progress_thread,
            ucx_set=ucx,
        )

    @classmethod
    def create(
        cls, pools: list[torch.Tensor], layout: KvLayout, progress_thread: bool = False, direct: bool = True
    ) -> NixlKvAgent | None:
        """The agent with every pool registered, or None (logged) where NIXL does not work."""
        api = load_nixl()
        if api is None:
            return None
        try:
            return cls(api, pools, layout, progress_thread, direct)
        except Exception as exc:  # no UCX plugin, registration refused: serve over gRPC
            log.warning("nixl_agent_failed", error=f"{type(exc).__name__}: {exc}")
            return None

    def source(self, dp_rank: int, block_ids: list[int], first_block: int) -> NixlSource:
        """What a peer needs to READ these blocks of rank dp_rank's pool."""
        pool = self._pools[dp_rank]
        return NixlSource(
            agent_name=self.name,
            agent_metadata=self._metadata,
            pool_address=pool.data_ptr(),
            pool_slots=pool.shape[3],
            device_id=max(pool.get_device(), 0),
            mem_type="DRAM" if pool.device.type == "cpu" else "VRAM",
            block_ids=tuple(block_ids),
            first_block=first_block,
            cuda_ipc=self._shares[dp_rank],
        )

    def _peer_pool(self, source: NixlSource) -> torch.Tensor | None:
        """The source's pool mapped here through CUDA IPC (mapped now if it can be), or None."""
        if self._peers is None:
            return None
        return self._peers.get(source.agent_name, source.cuda_ipc, source.pool_slots)

    def read_path(self, source: NixlSource) -> str:
        """How a read of `source` goes: "cuda_ipc" (its pool is mapped here) or "nixl"."""
        return "nixl" if self._peer_pool(source) is None else "cuda_ipc"

    def read(
        self,
        source: NixlSource,
        src_offset: int,
        dp_rank: int,
        block_ids: list[int],
        timeout_s: float,
        num_trimmed: int = 0,
        layers: tuple[int, ...] = (),
    ) -> int:
        """READ source.block_ids[src_offset : src_offset + len(block_ids)] into this worker's
        blocks block_ids of rank dp_rank, the first num_trimmed of them only in `layers` (the
        full-attention layers of a trimmed handoff, engine/kv_trim.py); returns the bytes read.

        Raises KvTransferFailed when the READ fails or is not done within timeout_s (the
        transfer is then released: NIXL cancels what is still in flight)."""
        src = list(source.block_ids[src_offset : src_offset + len(block_ids)])
        if len(src) != len(block_ids):
            raise errors.InvalidArgument(
                f"NIXL source has {len(source.block_ids)} blocks, {src_offset + len(block_ids)} needed"
            )
        pool = self._pools[dp_rank]
        remote_pool = self._peer_pool(source)
        if remote_pool is not None and self._peers is not None:
            self._bind()
            try:
                return kv_cuda_ipc.copy_blocks(
                    remote_pool,
                    pool,
                    self._layout.block_size,
                    src,
                    block_ids,
                    num_trimmed,
                    layers,
                    self._peers.stream(),
                )
            except Exception as exc:  # the mapping went bad (peer gone): its handoff falls back
                raise KvTransferFailed(f"CUDA IPC copy from {source.agent_name} failed: {exc}") from exc
        itemsize = pool.element_size()
        num_trimmed = min(num_trimmed, len(block_ids)) if layers else 0
        # (source blocks, our blocks, layers; None = all): the trimmed blocks, then the rest
        parts: list[tuple[list[int], list[int], tuple[int, ...] | None]] = [
            (src[:num_trimmed], block_ids[:num_trimmed], layers),
            (src[num_trimmed:], block_ids[num_trimmed:], None),
        ]
        remote_parts: list[np.ndarray] = []
        local_parts: list[np.ndarray] = []
        for part_src, part_dst, part_layers in parts:
            if not part_dst:
                continue
            runs = block_runs(part_src, part_dst)
            starts_src, starts_dst, counts = zip(*runs, strict=True)
            remote_parts.append(
                plane_descriptors(
                    source.pool_address,
                    source.pool_slots,
                    self._layout,
                    itemsize,
                    source.device_id,
                    list(starts_src),
                    list(counts),
                    part_layers,
                )
            )
            local_parts.append(
                plane_descriptors(
                    pool.data_ptr(),
                    pool.shape[3],
                    self._layout,
                    itemsize,
                    max(pool.get_device(), 0),
                    list(starts_dst),
                    list(counts),
                    part_layers,
                )
            )
        if not local_parts:
            return 0
        remote, local = np.concatenate(remote_parts), np.concatenate(local_parts)
        mem = "DRAM" if pool.device.type == "cpu" else "VRAM"
        self._bind()
        with self._lock:
            try:
                if source.agent_name not in self._remotes:
                    self._agent.add_remote_agent(source.agent_metadata)
                    self._remotes.add(source.agent_name)
                self._forget_later.discard(source.agent_name)
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, mem),
                    self._agent.get_xfer_descs(remote, source.mem_type),
                    source.agent_name,
                )
            except Exception as exc:
                raise KvTransferFailed(f"NIXL READ from {source.agent_name} could not start: {exc}") from exc
            state = self._wait(handle, timeout_s)
            if state == "PROC":
                # Releasing the handle would not stop it (measured with UCX: the bytes of a
                # released READ still land once the peer progresses): keep it until it ends.
                pending = _PendingRead(handle, source.agent_name)
                self._unsettled.append(pending)
                self._start_reaper()
                raise KvTransferUnsettled(
                    f"NIXL READ from {source.agent_name} timed out after {timeout_s} s", pending
                )
            self._release(handle)
        if state != "DONE":
            raise KvTransferFailed(f"NIXL READ from {source.agent_name} failed ({state})")
        return int(local[:, 1].sum())

    def _bind(self) -> None:
        """Make the pools' GPU current in this thread (cheap; nothing on CPU)."""
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)

    def progress(self) -> None:
        """Let the agent answer peers' READs of its memory (the prefill side calls this while a
        handoff is in flight). Skipped while this agent's own READ runs: its wait progresses;
        and always with NIXL's progress thread."""
        if not self.progress_thread and self._lock.acquire(blocking=False):
            try:
                self._bind()
                self._agent.get_new_notifs()  # drives the UCX worker's progress
            finally:
                self._lock.release()

    def _wait(self, handle: Any, timeout_s: float) -> str:
        """The READ's state once it ended (DONE, or an error), or PROC at the timeout."""
        deadline = time.monotonic() + timeout_s
        state = self._state(handle, post=True)
        while state == "PROC" and time.monotonic() <= deadline:
            time.sleep(_POLL_S)
            state = self._state(handle)
        return state

    def _state(self, handle: Any, post: bool = False) -> str:
        """DONE, PROC, or why it failed. NIXL raises rather than answers ERR for some ends
        (measured: NIXL_ERR_REMOTE_DISCONNECT once the peer process is killed); those are ends
        too (a dead peer's memory can write nothing any more)."""
        try:
            return str(self._agent.transfer(handle) if post else self._agent.check_xfer_state(handle))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # the transfer ended: a handle it cannot free leaks, no more
            log.warning("nixl_release_failed", error=f"{type(exc).__name__}: {exc}")

    def num_unsettled(self) -> int:
        """Timed-out READs still in flight (their target blocks quarantined)."""
        with self._lock:
            return len(self._unsettled)

    def _start_reaper(self) -> None:
        """(Under the lock.) A thread that watches the timed-out READs until every one ended."""
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(target=self._reap, name="nixl-reaper", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        """Check the unsettled READs (their checks also progress this agent), less often the
        longer they last; release and settle each that ended; stop when none is left."""
        delay = _REAP_FIRST_S
        self._bind()
        while True:
            time.sleep(delay)
            delay = min(delay * 2, _REAP_MAX_S)
            with self._lock:
                ended = [p for p in self._unsettled if self._state(p.handle) != "PROC"]
                for pending in ended:
                    self._release(pending.handle)
                self._unsettled = [p for p in self._unsettled if p not in ended]
                waiting = {p.peer for p in self._unsettled}
                for peer in self._forget_later - waiting:
                    self._remove_remote(peer)
                self._forget_later &= waiting
                finished = not self._unsettled
                if finished:
                    self._reaper = None
            for pending in ended:
                log.info("nixl_read_settled", peer=pending.peer)
                pending.settle()
            if finished:
                return

    def forget(self, agent_name: str) -> None:
        """Drop a peer's metadata and mapped pools (after a failed READ: the peer may have
        restarted); its NIXL metadata once its unsettled READs ended, when it has some (removed,
        their state could not be read)."""
        if self._peers is not None:
            self._peers.forget(agent_name)
        with self._lock:
            if any(p.peer == agent_name for p in self._unsettled):
                self._forget_later.add(agent_name)
            else:
                self._remove_remote(agent_name)

    def _remove_remote(self, agent_name: str) -> None:
        """(Under the lock.)"""
        if agent_name in self._remotes:
            self._remotes.discard(agent_name)
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:
                log.debug("nixl_forget_failed", agent=agent_name, error=str(exc))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
