"""Where a request's KV blocks are in a pool, as NIXL reads them: runs of blocks consecutive on
both sides (`block_runs`) and one memory region per (layer, K/V, head) plane per run
(`plane_descriptors`); the pool layout is [layers, 2 (K, V), kv_heads, slots, head_dim], so a block
is not one region (kv_nixl.py's docstring says why and what it measured)."""

from __future__ import annotations

import numpy as np

from shared.cluster import KvLayout


def block_runs(src: list[int] | tuple[int, ...], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count): maximal runs where both block ids go up by one."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def plane_descriptors(
    pool_address: int,
    pool_slots: int,
    layout: KvLayout,
    itemsize: int,
    device_id: int,
    starts: list[int],
    counts: list[int],
    layers: tuple[int, ...] | None = None,
) -> np.ndarray:
    """N x 3 (address, bytes, device id): for every (layer, K/V, head) plane (of `layers` only,
    when set: a trimmed handoff, engine/kv_trim.py), one region per run of blocks (run i starts
    at block starts[i] and covers counts[i] blocks)."""
    block_bytes = layout.block_size * layout.head_dim * itemsize
    plane_bytes = pool_slots * layout.head_dim * itemsize
    per_layer = 2 * layout.num_kv_heads  # planes of one layer, consecutive in the pool
    plane_ids = np.arange(layout.num_layers * per_layer, dtype=np.uint64)
    if layers is not None:
        plane_ids = plane_ids.reshape(layout.num_layers, per_layer)[list(layers)].reshape(-1)
    num_planes = len(plane_ids)
    planes = plane_ids[:, None] * np.uint64(plane_bytes)
    offsets = np.asarray(starts, dtype=np.uint64)[None, :] * np.uint64(block_bytes)
    descs = np.empty((num_planes, len(starts), 3), dtype=np.uint64)
    descs[:, :, 0] = np.uint64(pool_address) + planes + offsets
    descs[:, :, 1] = np.asarray(counts, dtype=np.uint64)[None, :] * np.uint64(block_bytes)
    descs[:, :, 2] = device_id
    return descs.reshape(-1, 3)
