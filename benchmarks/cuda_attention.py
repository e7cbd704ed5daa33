"""Decode attention over the paged KV pool on a GPU, one layer of a real model shape: the
in-place FlexAttention path (engine/flex_paged.py, the default on CUDA) against the torch-only
path it replaced (attention.py's BATCHED backend: whole blocks gathered into a padded buffer per
step + SDPA with an additive mask), in one run, with the KV floor (the sequences' K/V read once
at the device's measured bandwidth). `--block-sizes` also times the in-place path over pools of
larger blocks: FlexAttention's KV tile is at most one pool block (16 tokens by default), so the
sweep says what a larger `--block-size` would buy per step on this GPU.

Both run as CUDA graphs (as the engine replays them), each graph holding `--repeat` calls so the
timing is the kernels' and not the launches'. Blocks are scattered over a pool (as a serving
block manager leaves them), block size 16 (and each of `--block-sizes`), bf16. Outputs of the two
paths are compared (bf16 tolerance) before timing.

    python -m benchmarks.cuda_attention [--shape llama-8b] [--batches 1 8 64] [--contexts 512 2048]
        [--block-sizes 16 32 64 128]

Writes benchmarks/results/cuda-attention-<gpu>.json. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_floor import cuda_bandwidth
from services.worker.engine import attention
from services.worker.engine.decode_graphs import bucket
from services.worker.engine.flex_paged import FlexPagedStep
from shared.model_store import RANDOM_SHAPES

RESULTS = Path(__file__).parent / "results"


def _graph_ms(fn: Any, repeat: int) -> float:
    """Milliseconds per call of `fn`, `repeat` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3 / repeat


def _in_place(
    layer_kv: torch.Tensor,  # [2, kv_heads, slots, D]
    tables: list[list[int]],
    ctx: int,
    bs: int,
    q: torch.Tensor,  # [b, heads, D]
    scale: float,
) -> Callable[[], torch.Tensor]:
    """The engine's in-place attention over `layer_kv` as a pool of `bs`-token blocks (its last
    block the scratch one), block tables as wide as an 8192-token sequence (the engine's width)."""
    blocks_total = layer_kv.shape[2] // bs - 1
    width = max(len(tables[0]), 8192 // bs)
    flex = FlexPagedStep.new(len(tables), 1, width, bs, blocks_total + 1, blocks_total, q.device)
    flex.fill(tables, [[ctx]] * len(tables), blocks_total)

    def in_place() -> torch.Tensor:
        flex.prepare()
        return flex.attend(q, layer_kv[0], layer_kv[1], scale)

    return in_place


def _flex_ms(
    b: int,
    ctx: int,
    bs: int,
    q: torch.Tensor,  # [b, heads, D]
    kv_heads: int,
    pool_tokens: int,
    scale: float,
    repeat: int,
    rng: random.Random,
) -> float:
    """In-place attention of b sequences of ctx tokens over a pool of `bs`-token blocks
    (scattered, as in measure), ms per call."""
    blocks_total = pool_tokens // bs
    per_seq = -(-ctx // bs)
    layer_kv = torch.randn(2, kv_heads, (blocks_total + 1) * bs, q.shape[-1], device=q.device, dtype=q.dtype)
    blocks = rng.sample(range(blocks_total), b * per_seq)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(b)]
    in_place = _in_place(layer_kv, tables, ctx, bs, q, scale)
    in_place()
    return _graph_ms(in_place, repeat)


def measure(
    shape: str,
    batches: list[int],
    contexts: list[int],
    repeat: int,
    pool_blocks: int,
    block_sizes: list[int] | None = None,
) -> dict[str, Any]:
    cfg = RANDOM_SHAPES[shape]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    bs = 16
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    scale = dim**-0.5
    layer_kv = torch.randn(2, kv_heads, (pool_blocks + 1) * bs, dim, device=dev, dtype=dtype)
    bandwidth = cuda_bandwidth(dev)
    rng = random.Random(0)
    rows = []
    for ctx in contexts:
        for b in batches:
            per_seq = -(-ctx // bs)
            if b * per_seq > pool_blocks:
                continue
            blocks = rng.sample(range(pool_blocks), b * per_seq)
            tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(b)]
            q = torch.randn(b, heads, dim, device=dev, dtype=dtype)
            in_place = _in_place(layer_kv, tables, ctx, bs, q, scale)

            # gathered: the old static step's bucket of blocks per sequence
            nb = bucket(per_seq, 4)
            table = torch.tensor([x for t in tables for x in t + [pool_blocks] * (nb - per_seq)], device=dev)
            keys = nb * bs
            visible = torch.arange(keys, device=dev)[None, :] < ctx
            mask = torch.zeros(b, 1, 1, keys, dtype=dtype, device=dev).masked_fill_(~visible, float("-inf"))
            group = attention.BatchedGroup(None, table, mask, None, None, b, 1, nb)

            def gathered(group: attention.BatchedGroup = group, q: torch.Tensor = q) -> torch.Tensor:
                return attention._group_attention(q.transpose(0, 1), layer_kv, bs, group, kv_heads, scale)

            t0 = time.perf_counter()
            a = in_place()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            g = gathered().view(b, heads, dim)
            err = (a.float() - g.float()).abs().max().item()
            kv_bytes = b * ctx * kv_heads * dim * 2 * 2
            floor_ms = kv_bytes / bandwidth * 1e3
            flex_ms = _graph_ms(in_place, repeat)
            gather_ms = _graph_ms(gathered, repeat)
            row = {
                "seqs": b,
                "context": ctx,
                "kv_mb": round(kv_bytes / 1e6, 2),
                "floor_ms": round(floor_ms, 4),
                "flex_in_place_ms": round(flex_ms, 4),
                "gather_sdpa_ms": round(gather_ms, 4),
                "flex_vs_floor": round(flex_ms / floor_ms, 2),
                "gather_vs_floor": round(gather_ms / floor_ms, 2),
                "gather_over_flex": round(gather_ms / flex_ms, 2),
                "max_abs_diff": err,
                "first_call_s": round(compile_s, 2),
            }
            for other in block_sizes or ():
                if other == bs or b * -(-ctx // other) > pool_blocks * bs // other:
                    continue
                ms = _flex_ms(b, ctx, other, q, kv_heads, pool_blocks * bs, scale, repeat, rng)
                row[f"flex_block{other}_ms"] = round(ms, 4)
                row[f"flex_block{other}_vs_floor"] = round(ms / floor_ms, 2)
            print(row, flush=True)
            rows.append(row)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "shape": shape,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "block_size": bs,
        "other_block_sizes": [x for x in block_sizes or () if x != bs],
        "dtype": "bfloat16",
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "rows": rows,
        "command": "python -m benchmarks.cuda_attention"
        + (" --block-sizes " + " ".join(map(str, block_sizes)) if block_sizes else ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b", choices=sorted(RANDOM_SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--pool-blocks", type=int, default=16384)
    ap.add_argument(
        "--block-sizes", type=int, nargs="*", default=[], help="also time in place over these block sizes"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    doc = measure(a.shape, a.batches, a.contexts, a.repeat, a.pool_blocks, a.block_sizes)
    gpu = re.sub(r"[^a-z0-9]+", "-", doc["gpu"].lower()).strip("-")
    out = a.out or RESULTS / f"cuda-attention-{gpu}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
