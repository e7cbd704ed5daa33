"""Where a CUDA decode step's time goes: one rank's static decode step (replayed as a CUDA graph,
as the engine serves it) under torch.profiler, kernel time summed by kernel name, for a random
weight model of a real shape. The sum of kernel times against the step's wall time tells
launch gaps from kernel work; the top kernels say which to fuse or replace next.

    python -m benchmarks.cuda_step_profile [--model random:llama-8b] [--seqs 8] [--context 319]
        [--paths fused torch]

Several `--seqs` profile one model (loaded once) at each batch size: `runs` in the result.
`--mixed 60:2048` also profiles a mixed step as chunked prefill runs it (eager: 60 sequences
decoding plus a 2,048-token prompt chunk) against its roofline: `mixed` in the result.
`--block-sizes 16 32` profiles each path over pools of each block size (FlexAttention's KV tile
is one pool block; keys `fused_in_place_block32` etc. for sizes other than 16). Each run has its
floor: the weights plus the batch's KV read once at the bandwidth measured here.

Writes benchmarks/results/cuda-step-profile-<gpu>.json. Needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_floor import (
    cuda_bandwidth,
    gemm_flops,
    mixed_row,
    read_bandwidth,
    step_blocks,
    time_decode_steps,
    time_mixed_step,
    weight_bytes_per_step,
)
from benchmarks.result_names import gpu_tag
from services.worker.engine.backend import ModelBackend
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.options import BackendOptions
from shared.model_store import resolve_model

RESULTS = Path(__file__).parent / "results"


def _kernels(run: Callable[[], Any], steps_per_call: int, calls: int = 5) -> dict[str, Any]:
    """Kernel time by name per step under torch.profiler: `run` called `calls` times, each
    running `steps_per_call` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    # (CPU activity only in a CPU smoke test: no kernels are counted then)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with torch_profile(activities=[activity]) as prof:
        for _ in range(calls):
            run()
    by_name: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            by_name[evt.name] += evt.device_time_total
            counts[evt.name] += 1
    per_step = steps_per_call * calls
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
        "kernel_ms_per_step": round(total_us / 1e3, 3),
        "kernels_per_step": round(sum(counts.values()) / per_step, 1),
        "top": top,
    }


def _runner(model: Any, blocks: int, fused: bool | None, block: int) -> ModelRunner:
    dev = next(model.parameters()).device
    layout = kv_layout_of(model.config, block, torch.bfloat16)
    # static steps as CUDA graphs; fused False: the torch-only path (--no-cuda-kernels)
    backend = ModelBackend.choose(BackendOptions(cuda_kernels=fused is not False), dev)
    return ModelRunner(model, layout, blocks, dev, torch.bfloat16, backend=backend)


def profile(model: Any, seqs: int, context: int, fused: bool | None, block: int = 16) -> dict[str, Any]:
    """A decode step of `seqs` sequences over `context` tokens (a graph replay)."""
    runner = _runner(model, step_blocks(block, seqs, context) + 1, fused, block)  # + the scratch block
    step_s, _ = time_decode_steps(runner, seqs, context)
    # time_decode_steps(steps=1) runs 3 steps (2 warm-ups)
    kernels = _kernels(functools.partial(time_decode_steps, runner, seqs, context, steps=1), 3)
    del runner
    torch.cuda.empty_cache()
    return {"step_ms": round(step_s * 1e3, 3), **kernels}


def profile_mixed(
    model: Any,
    decode: int,
    prefill: int,
    context: int,
    block: int,
    bandwidth: float,
    flops: float,
    chunks: int = 1,
) -> dict[str, Any]:
    """A mixed step as chunked prefill runs it (eager): `decode` sequences decoding over `context`
    tokens plus `prefill` prompt tokens as `chunks` fresh prompts, against its roofline
    (engine_floor.mixed_row)."""
    runner = _runner(model, step_blocks(block, decode, context, prefill, chunks) + 1, None, block)
    row = mixed_row(runner, model, bandwidth, flops, decode, prefill, context, chunks)
    # time_mixed_step(steps=1) runs 2 warm-ups and one timed step on CUDA
    timed = functools.partial(time_mixed_step, runner, decode, prefill, context, steps=1, chunks=chunks)
    kernels = _kernels(timed, 3)
    del runner
    torch.cuda.empty_cache()
    return {**row, **kernels}


def _mixed_spec(spec: str) -> tuple[int, int, int]:
    """ "60:2048" -> (60, 1, 2048); "0:4x512" -> (0, 4, 512): decoding sequences, fresh prompts,
    tokens per prompt."""
    decode, _, prompt = spec.partition(":")
    count, _, each = prompt.rpartition("x")
    return int(decode), int(count or 1), int(each)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-8b")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8])
    ap.add_argument("--context", type=int, default=319)
    ap.add_argument("--paths", nargs="+", default=["fused", "torch"], choices=["fused", "torch"])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16], help="pool block sizes (tokens)")
    ap.add_argument(
        "--mixed",
        nargs="*",
        default=[],
        metavar="DECODE:[PROMPTSx]TOKENS",
        help="also profile mixed steps (eager): DECODE sequences decoding over --context tokens plus "
        "PROMPTS fresh prompts of TOKENS each (default 1), e.g. 60:2048 or 0:4x512 (a burst's step; "
        "on the first of --block-sizes)",
    )
    ap.add_argument(
        "--quantization",
        default="",
        choices=["", "fp8"],
        help="the engine's --quantization (fp8: the floor counts FP8 weight bytes)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    mixed = [_mixed_spec(m) for m in a.mixed]
    t0 = time.perf_counter()
    dev = torch.device(a.device)
    model = load_model(str(resolve_model(a.model)), dev, torch.bfloat16, quantization=a.quantization)
    bandwidth = cuda_bandwidth(dev) if dev.type == "cuda" else read_bandwidth(1)
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
    mixed_rows = []
    if mixed:
        flops = gemm_flops(dev, 4096, dtype=torch.bfloat16)
        for decode, prompts, each in mixed:
            m = profile_mixed(
                model, decode, prompts * each, a.context, a.block_sizes[0], bandwidth, flops, prompts
            )
            print(
                f"mixed {decode} decoding + {prompts} x {each} prompt tokens: step {m['step_ms']} ms, "
                f"roofline {m['roofline_ms']} ms ({m['vs_roofline']}x), kernels {m['kernel_ms_per_step']} ms "
                f"({m['kernels_per_step']}/step)"
            )
            for row in m["top"][:12]:
                print(f"   {row['us_per_step']:>8.1f} us  x{row['calls_per_step']:<6g} {row['kernel']}")
            mixed_rows.append(m)
    doc: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "none (cpu)",
        "torch": torch.__version__,
        "model": a.model,
        "quantization": a.quantization,
        "bandwidth_gb_s": round(bandwidth / 1e9, 1),
        # one batch size: its profiles at the top level (the first results' layout)
        **(runs[0] if len(runs) == 1 else {"runs": runs}),
        **({"mixed": mixed_rows} if mixed_rows else {}),
        "command": "python -m benchmarks.cuda_step_profile --seqs "
        + " ".join(map(str, a.seqs))
        + f" --context {a.context} --paths "
        + " ".join(a.paths)
        + " --block-sizes "
        + " ".join(map(str, a.block_sizes))
        + (" --mixed " + " ".join(a.mixed) if a.mixed else "")
        + (f" --model {a.model}" if a.model != "random:llama-8b" else "")
        + (f" --quantization {a.quantization}" if a.quantization else ""),
    }
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    out = a.out or RESULTS / f"cuda-step-profile-{gpu_tag(doc['gpu'])}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
