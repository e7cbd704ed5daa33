"""NIXL READ (and WRITE) of one request's KV between two processes, as the workers do it.

Why: on an H200 (2026-11-27) the 8B shape's 2,048-token handoff (256 MiB, one run of blocks =
512 plane descriptors of 512 KiB) took ~615 ms over NIXL inside `bench_stack`, 0.41 GiB/s. Two
suspects: READs issued from a thread with no CUDA context (UCX then cannot use CUDA IPC and
stages through host buffers), and the target's progress (~1 ms per answer on the worker's event
loop). This probe separates the transport from the stack: a target process registers a pool of
the model's KV layout and progresses its agent one way (`none`, `poll` every `--poll-us`, `spin`,
or NIXL's own progress `thread`); the main process READs a run of blocks (one descriptor per
plane) or scattered blocks (one per plane per block), from its main thread or from a fresh one
where torch set no device (as a worker's READs run), checks the bytes, and reports ms and GiB/s.

What it showed on the H200 (2026-11-28): 506-576 ms from any thread and mode; UCX's protocol
table named "software emulation | tcp/lo" for the GET of VRAM, UCX having turned CUDA IPC's
get_zcopy off on a GPU without NVLink. `--ucx worker` (the default) runs with the UCX settings a
worker applies on GPUs (kv_nixl.UCX_CUDA_DEFAULTS), `--ucx as-is` without them, for the A/B.
`--ops READ WRITE` also times the same blocks moved the other way, a WRITE (a PUT in UCX) from
the main process into the target's pool, checked by the target: CUDA IPC's put_zcopy is not
switched off without NVLink as its get_zcopy is, so if the GET stays slow on a GPU, a WRITE from
the prefill side (as SGLang's and Dynamo's NIXL transfers do) is the measured alternative.
`--ops IPC` times what a decode worker does instead of a READ within one host on GPUs
(kv_cuda_ipc.py): the target's pool shared through CUDA IPC, mapped here once, the same blocks
copied device to device.

  python -m benchmarks.nixl_probe --device cuda --modes poll spin thread --ucx worker as-is --out r.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.bench_stack import machine
from services.worker import kv_cuda_ipc
from services.worker.kv_descriptors import block_runs, plane_descriptors
from services.worker.kv_nixl import UCX_CUDA_DEFAULTS, ucx_cuda_defaults
from shared.cluster import KvLayout

_LAYOUTS = {  # name: (layers, kv_heads, head_dim)
    "llama-8b": (32, 8, 128),
    "smollm2": (30, 3, 64),
}


def _pool(layout: KvLayout, slots: int, device: str, dtype: torch.dtype, fill: float) -> torch.Tensor:
    shape = (layout.num_layers, 2, layout.num_kv_heads, slots, layout.head_dim)
    pool = torch.empty(shape, dtype=dtype, device=device)
    # each block's value tells it from its neighbours: (block id mod 97) + the side's fill,
    # integers bf16 holds exactly
    pool.copy_(
        torch.arange(slots, device=device, dtype=torch.float32)
        .div(layout.block_size, rounding_mode="floor")
        .remainder(97)
        .add(fill)
        .view(1, 1, 1, slots, 1)
        .expand(shape)
    )
    return pool


def _in_fresh_thread(fn: Callable[[], float]) -> float:
    """fn's result, run in a new thread where torch never set a device (as a worker's READ runs
    in a pool thread)."""
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the READ failed in its thread")
    return out[0]


def _target(
    conn: Any, mode: str, poll_us: int, layout: KvLayout, slots: int, device: str, dtype: str
) -> None:
    from nixl_cu13 import _api as api

    pool = _pool(layout, slots, device, getattr(torch, dtype), 1.0)
    config = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=mode == "thread")
    agent = api.nixl_agent(f"target-{mode}", config)
    agent.register_memory(pool)
    torch.cuda.synchronize() if device == "cuda" else None
    conn.send((agent.get_agent_metadata(), pool.data_ptr(), kv_cuda_ipc.share(pool)))
    while True:
        while not conn.poll(0):
            if mode in ("poll", "spin"):
                agent.get_new_notifs()
            if mode == "poll":
                time.sleep(poll_us * 1e-6)
            elif mode in ("none", "thread"):
                time.sleep(0.001)
        message = conn.recv()
        if message == "reset":  # before a transfer: this side's own values again
            pool.copy_(_pool(layout, slots, device, getattr(torch, dtype), 1.0))
            torch.cuda.synchronize() if device == "cuda" else None
            conn.send(True)
        elif isinstance(message, tuple):  # ("check", slots, values): what a WRITE left here
            _, at, want = message
            conn.send(pool[0, 0, 0, at, 0].float().cpu().tolist() == want)
        else:
            return


def _transfer(op: str, agent: Any, name: str, local: np.ndarray, remote: np.ndarray, mem: str) -> float:
    """ms for one transfer, READ (remote -> local) or WRITE (local -> remote), polled to its end."""
    t0 = time.perf_counter()
    handle = agent.initialize_xfer(
        op, agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), name
    )
    state = agent.transfer(handle)
    deadline = t0 + 30
    while state == "PROC" and time.perf_counter() < deadline:
        state = agent.check_xfer_state(handle)
    ms = (time.perf_counter() - t0) * 1e3
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"{op} ended {state}")
    return ms


def probe(mode: str, ucx: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from nixl_cu13 import _api as api

    # UCX reads its variables when an agent is made: here, and in the target (spawned after)
    for key in UCX_CUDA_DEFAULTS:
        os.environ.pop(key, None)
    if ucx == "worker" and args.device == "cuda":
        ucx_cuda_defaults()

    layers, heads, dim = _LAYOUTS[args.layout]
    layout = KvLayout(
        num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=args.block_size, dtype=args.dtype
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_target, args=(child, mode, args.poll_us, layout, args.slots, args.device, args.dtype)
    )
    proc.start()
    rows = []
    try:
        metadata, remote_addr, ipc_share = parent.recv()
        dtype = getattr(torch, args.dtype)
        pool = _pool(layout, args.slots, args.device, dtype, 0.0)
        config = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=mode == "thread")
        agent = api.nixl_agent(f"reader-{mode}", config)
        agent.register_memory(pool)
        name = agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        mem = "VRAM" if args.device == "cuda" else "DRAM"
        dev = 0
        nblocks = args.tokens // args.block_size
        itemsize = pool.element_size()
        for shape in args.shapes:
            if shape == "run":
                src = list(range(nblocks))
                dst = list(range(args.slots // args.block_size - nblocks, args.slots // args.block_size))
            else:  # scattered: every other block on the source, reversed on the reader
                src = list(range(0, 2 * nblocks, 2))
                dst = list(reversed(range(nblocks)))
            runs = block_runs(src, dst)
            s0, d0, counts = (list(x) for x in zip(*runs, strict=True))
            at = [d * args.block_size for d in dst]
            for op in args.ops:
                # READ: the target's src blocks into ours at dst; WRITE: ours at src into its dst
                their_starts, our_starts = (s0, d0) if op in ("READ", "IPC") else (d0, s0)
                theirs = plane_descriptors(
                    remote_addr, args.slots, layout, itemsize, dev, their_starts, counts
                )
                ours = plane_descriptors(
                    pool.data_ptr(), args.slots, layout, itemsize, dev, our_starts, counts
                )
                for where in args.threads:
                    # both sides as they started (an earlier WRITE changed the target's blocks)
                    if op in ("READ", "IPC"):
                        pool.zero_()
                    else:
                        pool.copy_(_pool(layout, args.slots, args.device, dtype, 0.0))
                    parent.send("reset")
                    parent.recv()

                    def once(
                        op: str = op,
                        local: np.ndarray = ours,
                        remote: np.ndarray = theirs,
                        src: list[int] = src,
                        dst: list[int] = dst,
                    ) -> float:
                        if op == "IPC":
                            return _ipc_copy(layout, pool, ipc_share, args.slots, src, dst)
                        return _transfer(op, agent, name, local, remote, mem)

                    run_in = once if where == "main" else lambda once=once: _in_fresh_thread(once)
                    times = [run_in() for _ in range(args.repeat)]
                    if op in ("READ", "IPC"):
                        got = pool[0, 0, 0, at, 0].float()
                        want = torch.tensor([s % 97 + 1.0 for s in src], device=args.device)
                        ok = bool(torch.equal(got, want))
                    else:
                        parent.send(("check", at, [s % 97 + 0.0 for s in src]))
                        ok = bool(parent.recv())
                    rows.append(_row(op, mode, ucx, shape, where, ours, times, ok))
    finally:
        parent.send("stop")
        proc.join(10)
    return rows


_PEERS: dict[Any, kv_cuda_ipc.PeerPools] = {}  # by share: one mapping per target


def _ipc_copy(
    layout: KvLayout, pool: torch.Tensor, share: Any, slots: int, src: list[int], dst: list[int]
) -> float:
    """ms for one copy of the target's src blocks into ours at dst through its CUDA IPC share
    (mapped on first use, as a decode worker maps a peer's pool once)."""
    if share is None:
        raise RuntimeError("the target's pool is not shared through CUDA IPC (a CPU pool)")
    peers = _PEERS.setdefault(share.key(), kv_cuda_ipc.PeerPools(layout, pool.device, pool.dtype))
    remote = peers.get("target", share, slots)
    if remote is None:
        raise RuntimeError("the target's pool is not shared through CUDA IPC here (a CPU pool?)")
    t0 = time.perf_counter()
    kv_cuda_ipc.copy_blocks(remote, pool, layout.block_size, src, dst, stream=peers.stream())
    return (time.perf_counter() - t0) * 1e3


def _row(
    op: str, mode: str, ucx: str, shape: str, where: str, local: np.ndarray, times: list[float], ok: bool
) -> dict[str, Any]:
    mib = int(local[:, 1].sum()) / 2**20
    best = min(times)
    row = {
        "op": op,
        "mode": mode,
        "ucx": ucx,
        "shape": shape,
        "thread": where,
        "descriptors": len(local),
        "mib": round(mib, 1),
        "ms_all": [round(t, 3) for t in times],
        "ms_best": round(best, 3),
        "gib_per_s": round(mib / 1024 / (best / 1e3), 2),
        "bytes_ok": ok,
    }
    print(row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", choices=sorted(_LAYOUTS), default="llama-8b")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--slots", type=int, default=8192, help="pool slots (tokens) per side")
    p.add_argument("--tokens", type=int, default=2048, help="tokens READ (one request's prompt)")
    p.add_argument(
        "--modes", nargs="+", default=["thread", "spin", "poll"], choices=["thread", "spin", "poll", "none"]
    )
    p.add_argument("--poll-us", type=int, default=1000)
    p.add_argument("--shapes", nargs="+", default=["run", "scattered"])
    p.add_argument(
        "--threads",
        nargs="+",
        default=["main", "fresh"],
        choices=["main", "fresh"],
        help="READ from the thread that made the pool, or from a new thread (a worker's READs)",
    )
    p.add_argument(
        "--ops",
        nargs="+",
        default=["READ"],
        choices=["READ", "WRITE", "IPC"],
        help="READ the target's blocks (what workers do), WRITE ours into its pool, or copy them "
        "through CUDA IPC (what a decode worker does within one host on GPUs)",
    )
    p.add_argument(
        "--ucx",
        nargs="+",
        default=["worker"],
        choices=["worker", "as-is"],
        help="with the UCX settings a worker applies on GPUs (kv_nixl.UCX_CUDA_DEFAULTS) or without",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for ucx in args.ucx:
        for mode in args.modes:
            try:
                rows += probe(mode, ucx, args)
            except Exception as exc:  # e.g. CUDA IPC refused here: a result too, and the rest runs
                row = {"mode": mode, "ucx": ucx, "error": f"{type(exc).__name__}: {exc}"[:500]}
                print(row, flush=True)
                rows.append(row)
    result = {"rows": rows, "config": vars(args), "machine": machine(args.device)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
