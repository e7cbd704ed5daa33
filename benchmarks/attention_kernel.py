"""The CPU decode attention kernel against SDPA per sequence (issue 15).

One decode step's attention: `seqs` sequences of `context` cached tokens each, one query token
each, over `layers` layers whose KV pools are distinct memory (so K and V come from DRAM, as in a
step), SmolLM2's shapes by default (3 KV heads, 3 query heads per KV head, head size 64, blocks of
16 tokens), one thread, pools on huge pages as the engine keeps them. Three block layouts:

- `consecutive`: each sequence's blocks one after another in the pool;
- `shuffled`: the pool's blocks handed out in random order (a pool after hours of churn);
- `cached`: every layer reads the same small pool (from cache: the kernel's arithmetic alone).

Contenders: engine/cpu_kernels.py's `decode_attention` on each instruction set this CPU has, and
SDPA per sequence (the blocks gathered, then `F.scaled_dot_product_attention`), the path the
kernel replaced. It prints and records ms per step (all layers), GB/s of K/V read, and the largest
difference from SDPA's outputs.

    python -m benchmarks.attention_kernel [--seqs 8] [--context 319] [--layers 30] [--out F]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_floor import cpu_features, read_bandwidth

LAYOUTS = ("consecutive", "shuffled", "cached")


def _tables(layout: str, seqs: int, per_seq: int, pool_blocks: int) -> torch.Tensor:
    ids = list(range(pool_blocks))
    if layout == "shuffled":
        random.Random(0).shuffle(ids)
    if layout == "cached":
        return torch.arange(per_seq).repeat(seqs, 1)  # every sequence reads the same blocks
    return torch.tensor(ids[: seqs * per_seq]).view(seqs, per_seq)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, bs: int
) -> torch.Tensor:
    """The engine's path without the kernel (attention.decode_attention without spans): one SDPA
    call per sequence over its slots, a view where its blocks are consecutive, else gathered."""
    from services.worker.engine import attention

    seqs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)]
        consecutive = bool((blocks == blocks[0] + torch.arange(len(blocks))).all())
        seqs.append(
            attention.SeqAttention(
                q_start=b,
                q_len=1,
                ctx_len=n,
                fresh=False,
                kv_start=int(blocks[0]) * bs if consecutive else None,
                blocks=None if consecutive else blocks,
                mask=None,
            )
        )
    out = attention.decode_attention(q, k.unsqueeze(0), v.unsqueeze(0), seqs, bs, 0.125)
    return out.view(q.shape)


def _kernel(
    q: torch.Tensor, lens: torch.Tensor, bs: int, isa: int, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    from services.worker.engine import cpu_kernels

    return cpu_kernels.decode_attention(q, k, v, t, lens, bs, 0.125, isa)


def measure(
    seqs: int = 8,
    context: int = 319,
    layers: int = 30,
    kv_heads: int = 3,
    q_per_kv: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    reps: int = 7,
) -> dict[str, Any]:
    """ms per step (all layers) for every layout and contender, on one thread."""
    from services.worker.engine import cpu_kernels

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_seq = -(-context // block_size)
        pool_blocks = seqs * per_seq
        pools = cpu_kernels.empty_on_huge_pages(
            (layers, 2, kv_heads, pool_blocks * block_size, head_dim), torch.float32
        ).normal_()
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(seqs, kv_heads, q_per_kv, head_dim, generator=gen)
        lens = torch.full((seqs,), context, dtype=torch.long)
        kv_bytes = layers * 2 * kv_heads * seqs * context * head_dim * 4
        # (K pool, V pool, block tables) -> [seqs, kv_heads, q_per_kv, head_dim]
        contenders: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {}
        if cpu_kernels.available():
            isas = [cpu_kernels.ISA_AVX2] + ([cpu_kernels.ISA_AVX512] if cpu_kernels.has_avx512() else [])
            for isa in isas:
                name = "kernel_avx512" if isa == cpu_kernels.ISA_AVX512 else "kernel_avx2"
                contenders[name] = functools.partial(_kernel, q, lens, block_size, isa)
        contenders["sdpa_per_sequence"] = lambda k, v, t: _sdpa(q, k, v, t, lens, block_size)
        out: dict[str, Any] = {}
        for layout in LAYOUTS:
            tables = _tables(layout, seqs, per_seq, pool_blocks)
            layer_pools = [pools[0 if layout == "cached" else i] for i in range(layers)]
            want = [_sdpa(q, p[0], p[1], tables, lens, block_size) for p in layer_pools[:2]]
            row = {}
            for name, fn in contenders.items():
                diff = max(
                    float((fn(p[0], p[1], tables) - w).abs().max())
                    for p, w in zip(layer_pools[:2], want, strict=True)
                )
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for p in layer_pools:
                        fn(p[0], p[1], tables)
                    best = min(best, time.perf_counter() - t0)
                row[name] = {
                    "ms": round(best * 1e3, 2),
                    "gb_s": round(kv_bytes / best / 1e9, 1),
                    "max_abs_diff": float(f"{diff:.1e}"),
                }
            out[layout] = row
        return {
            "shape": {
                "seqs": seqs,
                "context": context,
                "layers": layers,
                "kv_heads": kv_heads,
                "q_per_kv": q_per_kv,
                "head_dim": head_dim,
                "block_size": block_size,
            },
            "kv_mb": round(kv_bytes / 1e6, 1),
            "layouts": out,
        }
    finally:
        torch.set_num_threads(before)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=319)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    doc: dict[str, Any] = {
        "cpu": cpu_features(),
        "single_core_read_huge_pages_gb_s": round(read_bandwidth(1, huge_pages=True) / 1e9, 2),
    }
    doc.update(measure(a.seqs, a.context, a.layers, reps=a.reps))
    print(
        f"{doc['cpu']['model']} ({doc['cpu']['torch_cpu_capability']}), torch {doc['cpu']['torch']}, "
        f"1 thread; {doc['kv_mb']} MB of K/V per step; "
        f"one-core read {doc['single_core_read_huge_pages_gb_s']} GB/s"
    )
    for layout, row in doc["layouts"].items():
        for name, m in row.items():
            print(
                f"  {layout:12s} {name:18s} {m['ms']:7.2f} ms  {m['gb_s']:5.1f} GB/s  "
                f"max |diff| {m['max_abs_diff']:.1e}"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
