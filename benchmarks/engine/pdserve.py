"""The pdserve contenders: the engine in process (and with its forward-path switches off), the
prefix-heavy run with and without the prefix cache, and the decode-step floor probe."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import torch

from benchmarks.engine.workload import summarize
from services.worker.torch_metrics import compiled_frames


def _engine(args: argparse.Namespace, **overrides: Any) -> Any:
    from services.worker.engine import create_engine
    from services.worker.engine.api import EngineConfig

    settings: dict[str, Any] = {
        "model_path": args.model_path,
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "torch_threads": args.engine_threads,
        "dp_size": args.engine_dp_size,
        "block_size": args.block_size,
    }
    settings.update(overrides)
    engine = create_engine(EngineConfig(**settings))
    engine.start()
    return engine


async def _engine_round(
    engine: Any, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[float, list[list[float]], list[Any]]:
    from services.worker.engine.api import EngineRequest, SamplingConfig

    sampling = SamplingConfig(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    times: list[list[float]] = [[] for _ in prompts]
    last: list[Any] = [None] * len(prompts)

    async def one(i: int, handle: Any) -> None:
        async for out in handle:
            now = time.perf_counter()
            times[i].extend([now] * len(out.new_token_ids))
            last[i] = out

    t0 = time.perf_counter()
    dp = engine.config.dp_size
    handles = [
        engine.add_request(EngineRequest(f"{tag}{i}", tuple(p), sampling, dp_rank=i % dp))
        for i, p in enumerate(prompts)
    ]
    await asyncio.gather(*(one(i, h) for i, h in enumerate(handles)))
    return t0, times, last


def run_pdserve(args: argparse.Namespace, prompts: list[list[int]], **overrides: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    engine = _engine(args, enable_prefix_caching=False, **overrides)
    start_s = time.perf_counter() - t_start
    try:

        async def go() -> dict[str, Any]:
            await _engine_round(engine, [prompts[0][:16]], 2, "warm")
            before = [engine.step_stats(r) for r in range(engine.config.dp_size)]
            retries, frames = _alloc_retries(), compiled_frames()
            t0, times, _ = await _engine_round(engine, prompts, args.new_tokens, "r")
            result = summarize(t0, times, max(t[-1] for t in times) - t0)
            result["engine_start_s"] = round(start_s, 2)  # load + warm-up of every rank
            after = [engine.step_stats(r) for r in range(engine.config.dp_size)]
            result["steps"] = steps_by_kind(before, after)
            # what stalled a step (services/worker/torch_metrics.py)
            result["torch_compiles"] = compiled_frames() - frames
            if torch.cuda.is_available():
                result["gpu_alloc_retries"] = _alloc_retries() - retries
            return result

        return asyncio.run(go())
    finally:
        engine.shutdown()


def _alloc_retries() -> int:
    """Allocations torch's CUDA allocator retried after freeing its cache, on every GPU."""
    if not torch.cuda.is_available():
        return 0
    count = range(torch.cuda.device_count())
    return sum(int(torch.cuda.memory_stats(d).get("num_alloc_retries", 0)) for d in count)


def steps_by_kind(before: list[Any], after: list[Any]) -> dict[str, dict[str, Any]]:
    """The engine's steps of the measured round by kind (engine/step_stats.py), all ranks
    together, as engine_steps.delta reports a served phase's. Where a round's time went: the
    decode steps against the floor, the prefill and mixed steps the decode rows wait through."""
    from benchmarks import engine_steps

    return engine_steps.delta(
        {"engine": engine_steps.totals(before)}, {"engine": engine_steps.totals(after)}
    )["engine"]


def run_pdserve_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve with transformers' own forward (--no-lean-forward): what engine/lean_llama.py gains."""
    return run_pdserve(args, prompts, lean_forward=False)


def run_pdserve_eager(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve without CUDA graphs (--no-cuda-graphs): every decode step launched kernel by kernel."""
    return run_pdserve(args, prompts, cuda_graphs=False)


def run_pdserve_torch(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """CUDA: the same engine on the torch-only path (--no-cuda-kernels: KV gathered per step,
    layers unfused, graphs by batch x context), the baseline of the in-place kernels."""
    return run_pdserve(args, prompts, cuda_kernels=False)


def run_pdserve_fp8(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve with FP8 weights (--quantization fp8, engine/fp8.py): half the weight bytes of
    bf16 per decode step on a GPU."""
    return run_pdserve(args, prompts, quantization="fp8")


def run_pdserve_no_row_copy(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve without the CPU row copy (--no-cpu-row-copy): every step on oneDNN's kernel."""
    return run_pdserve(args, prompts, cpu_row_copy=False)


def run_prefix(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Shared 448-token prefix: prefill wall time with and without the prefix cache."""
    rng = random.Random(1)
    vocab = args.vocab_size
    prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_tokens)]
    batch = [prefix + [rng.randrange(100, vocab - 100) for _ in range(64)] for _ in range(args.num_requests)]
    out: dict[str, Any] = {"prefix_tokens": args.prefix_tokens, "requests": len(batch)}
    for label, caching in (("with_cache", True), ("without_cache", False)):
        engine = _engine(args, enable_prefix_caching=caching, dp_size=1)
        try:

            async def go(engine: Any = engine) -> tuple[float, list[Any]]:
                await _engine_round(engine, [prefix + [7] * 8], 1, "w")  # populates the cache
                t0, times, last = await _engine_round(engine, batch, 1, "p")
                return max(t[-1] for t in times) - t0, last

            wall, last = asyncio.run(go())
            load = engine.rank_loads()[0]
        finally:
            engine.shutdown()
        out[label] = {
            "prefill_wall_s": round(wall, 3),
            "cached_tokens": sum(o.num_local_cached_tokens for o in last),
            "prompt_tokens": sum(o.num_prompt_tokens for o in last),
            "hit_rate": round(load.prefix_cache_hit_rate, 4),
        }
    out["speedup"] = round(out["without_cache"]["prefill_wall_s"] / out["with_cache"]["prefill_wall_s"], 2)
    return out


def run_floor(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from benchmarks import engine_floor

    # the workload's mean context in the middle of decoding: mean prompt + half the new tokens
    context = sum(len(p) for p in prompts) // len(prompts) + args.new_tokens // 2
    batches = tuple(int(b) for b in args.floor_batches.split(","))
    return engine_floor.measure(
        args.model_path,
        args.device,
        args.dtype,
        max(1, args.engine_threads),
        batches,
        context,
        args.block_size,
    )
