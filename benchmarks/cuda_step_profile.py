"""Where a CUDA decode step's time goes: one rank's static decode step (replayed as a CUDA graph,
as the engine serves it) under torch.profiler, kernel time summed by kernel name, for a random
weight model of a real shape. The sum of kernel times against the step's wall time tells
launch gaps from kernel work; the top kernels say which to fuse or replace next.

    python -m benchmarks.cuda_step_profile [--model random:llama-8b] [--seqs 8] [--context 319]
        [--paths fused torch]

Several `--seqs` profile one model (loaded once) at each batch size: `runs` in the result.
`--block-sizes 16 32` profiles each path over pools of each block size (FlexAttention's KV tile
is one pool block; keys `fused_in_place_block32` etc. for sizes other than 16). Each run has its
floor: the weights plus the batch's KV read once at the bandwidth measured here.

Writes benchmarks/results/cuda-step-profile-<gpu>.json. Needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_floor import cuda_bandwidth, time_decode_steps, weight_bytes_per_step
from services.worker.engine.backend import ModelBackend
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.options import BackendOptions
from shared.model_store import resolve_model

RESULTS = Path(__file__).parent / "results"


def profile(model: Any, seqs: int, context: int, fused: bool | None, block: int = 16) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev = torch.device("cuda")
    layout = kv_layout_of(model.config, block, torch.bfloat16)
    per_seq = -(-(context + 1) // block)
    # static steps as CUDA graphs; fused False: the torch-only path (--no-cuda-kernels)
    backend = ModelBackend.choose(BackendOptions(cuda_kernels=fused is not False), dev)
    runner = ModelRunner(model, layout, seqs * per_seq + 1, dev, torch.bfloat16, backend=backend)
    step_s, _ = time_decode_steps(runner, seqs, context)
    steps = 5
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            time_decode_steps(runner, seqs, context, steps=1)
    by_name: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            by_name[evt.name] += evt.device_time_total
            counts[evt.name] += 1
    # time_decode_steps(steps=1) runs 3 steps (2 warm-ups): per-step figures divide by 3 * steps
    per_step = 3 * steps
    del runner
    torch.cuda.empty_cache()
    total_us = sum(by_name.values()) / per_step
    top = [
        {
            "kernel": name[:120],
            "us_per_step": round(us / per_step, 1),
            "calls_per_step": counts[name] / per_step,
        }
        for name, us in by_name.most_common(25)
    ]
    return {
        "step_ms": round(step_s * 1e3, 3),
        "kernel_ms_per_step": round(total_us / 1e3, 3),
        "kernels_per_step": round(sum(counts.values()) / per_step, 1),
        "top": top,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-8b")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8])
    ap.add_argument("--context", type=int, default=319)
    ap.add_argument("--paths", nargs="+", default=["fused", "torch"], choices=["fused", "torch"])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16], help="pool block sizes (tokens)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    model = load_model(str(resolve_model(a.model)), dev, torch.bfloat16)
    bandwidth = cuda_bandwidth(dev)
    layout = kv_layout_of(model.config, 16, torch.bfloat16)
    kv_bytes = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 2  # per token (bf16)
    runs = []
    for seqs in a.seqs:
        floor_ms = (weight_bytes_per_step(model, seqs) + seqs * a.context * kv_bytes) / bandwidth * 1e3
        run: dict[str, Any] = {"seqs": seqs, "context": a.context, "floor_ms": round(floor_ms, 3)}
        for path in a.paths:
            for block in a.block_sizes:
                key = ("fused_in_place" if path == "fused" else "torch_path") + (
                    "" if block == 16 else f"_block{block}"
                )
                run[key] = p = profile(model, seqs, a.context, None if path == "fused" else False, block)
                p["vs_floor"] = round(p["step_ms"] / floor_ms, 3)
                print(
                    f"{seqs} seqs, {key}: step {p['step_ms']} ms ({p['vs_floor']}x the floor "
                    f"{floor_ms:.3f}), kernels {p['kernel_ms_per_step']} ms ({p['kernels_per_step']}/step)"
                )
                for row in p["top"][:12]:
                    print(f"   {row['us_per_step']:>8.1f} us  x{row['calls_per_step']:<6g} {row['kernel']}")
        runs.append(run)
    doc: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "model": a.model,
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        # one batch size: its profiles at the top level (the first results' layout)
        **(runs[0] if len(runs) == 1 else {"runs": runs}),
        "command": "python -m benchmarks.cuda_step_profile --seqs "
        + " ".join(map(str, a.seqs))
        + f" --context {a.context} --paths "
        + " ".join(a.paths)
        + " --block-sizes "
        + " ".join(map(str, a.block_sizes)),
    }
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    gpu = re.sub(r"[^a-z0-9]+", "-", doc["gpu"].lower().replace("nvidia", "")).strip("-")
    out = a.out or RESULTS / f"cuda-step-profile-{gpu}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
