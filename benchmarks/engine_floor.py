"""The decode step against its memory-bandwidth floor (part of `make bench-engine`).

A decode step has to read every weight the step multiplies by (all linear layers and the LM
head; the embedding table only for the looked-up rows) and the cached K/V of every sequence in
the batch, once. Its floor is those bytes over the machine's memory read bandwidth:
    floor_s = (weight_bytes + batch_kv_bytes) / bandwidth
This module measures the bandwidth (a large tensor sum, one thread and all threads), reports
the CPU features torch sees (capability string, AVX-512, AMX), and times pure decode steps of
one engine rank (`ModelRunner`, one torch thread on CPU like a DP rank) for a few batch sizes,
each sequence holding `context` cached tokens; its step time is compared with the floor at the
single-core bandwidth (one rank alone streams from one core).

Memory is not the only floor: a step also does 2 x batch x weights FLOPs (plus attention), and
on a core with AVX2 FMA only (16 fp32 FLOPs per instruction) 8-16 rows of SmolLM2 already take
about as long to multiply as to stream. So the probe also measures the core's fp32 GEMM rate (a
large single-thread matmul) and reports the roofline floor = max(memory floor, compute floor);
`vs_roofline` is the step over that.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

_SUM_BYTES = 512 * 1024 * 1024  # far past any cache


def cpu_features() -> dict[str, Any]:
    """What torch and the kernel report about the CPU (flags from /proc/cpuinfo on Linux)."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    model = platform.processor() or platform.machine()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() == "model name":
                model = value.strip()
    return {
        "model": model,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": bool({"amx_tile", "amx_bf16"} & flags),
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "isa_env": {
            k: os.environ[k]
            for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if k in os.environ
        },
    }


def read_bandwidth(
    threads: int, nbytes: int = _SUM_BYTES, repeats: int = 5, huge_pages: bool = False
) -> float:
    """Memory read bandwidth in bytes/s: best of `repeats` sums of an `nbytes` fp32 tensor
    with `threads` torch threads (the best run is the one least disturbed by neighbours); with
    `huge_pages` the tensor is on transparent huge pages, as the engine's weights and KV pool
    are on CPU (cpu_kernels.empty_on_huge_pages; torch's own memory where the kernels are not
    built)."""
    from services.worker.engine import cpu_kernels

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if huge_pages:
            x = cpu_kernels.empty_on_huge_pages((nbytes // 4,), torch.float32).fill_(1.0)
        else:
            x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()  # first touch is done by the fill; one pass warms the code path
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(before)


def cuda_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def gemm_flops(
    device: torch.device, size: int = 1024, repeats: int = 3, dtype: torch.dtype = torch.float32
) -> float:
    """Matmul FLOP/s of one thread (CPU) or the device, in `dtype`: best of `repeats`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def flops_per_step(model: Any, batch: int, context: int) -> int:
    """Multiply-adds x 2 of one decode step: every linear over `batch` rows plus attention
    (scores and weighted values over `context` keys, every head and layer)."""
    from services.worker.engine.cpu_linear import PackedLinear
    from services.worker.engine.fp8 import Fp8Linear

    cfg = model.config.get_text_config()
    linear = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | PackedLinear | Fp8Linear)
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 2 * context * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    return 2 * batch * (linear + attn)


def weight_bytes_per_step(model: Any, batch: int) -> int:
    """Bytes of weights one forward over `batch` tokens reads: every linear weight (prepacked
    or not; a tied LM head counts once as the head), 1-D weights (norms), and `batch` rows of
    the input embedding."""
    from services.worker.engine.cpu_linear import PackedLinear
    from services.worker.engine.fp8 import Fp8Linear

    embed = model.get_input_embeddings().weight
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        tensors: list[torch.Tensor] = []
        if isinstance(mod, torch.nn.Linear):
            tensors = [mod.weight] + ([mod.bias] if mod.bias is not None else [])
        elif isinstance(mod, Fp8Linear):  # --quantization fp8: one byte a weight + scales
            tensors = [mod.weight_fp8, mod.weight_scale]
        elif isinstance(mod, PackedLinear):
            packed = mod.packed_weight
            assert isinstance(packed, torch.Tensor)  # a registered buffer
            bias = mod.bias
            tensors = [packed] + ([bias] if isinstance(bias, torch.Tensor) else [])
        else:
            tensors = [p for p in mod.parameters(recurse=False) if p.dim() == 1]
        for t in tensors:  # by identity: a tied head is the embedding's own Parameter
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    if id(embed) not in seen:  # untied (or prepacked) head: the table is only indexed
        total += batch * embed.shape[1] * embed.element_size()
    return total


def step_blocks(block_size: int, decode: int, context: int, prefill: int = 0, chunks: int = 1) -> int:
    """Pool blocks the timed steps below use: `decode` sequences over `context` cached tokens plus
    the one they decode, and `prefill` prompt tokens as `chunks` fresh prompts of equal length."""
    per_prompt = -(-(prefill // chunks) // block_size) if prefill else 0
    return decode * -(-(context + 1) // block_size) + chunks * per_prompt


def time_decode_steps(runner: Any, batch: int, context: int, steps: int = 8) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds of a pure decode step: `batch`
    sequences, each with `context` cached tokens (zeros in the pool; attention reads them all
    the same). On a shared machine CPU time is the less disturbed of the two (it still
    includes stalls on memory the neighbours compete for)."""
    from services.worker.engine.api import SamplingConfig
    from services.worker.engine.model_runner import ScheduledSeq

    bs = runner.layout.block_size
    per_seq = -(-(context + 1) // bs)
    if step_blocks(bs, batch, context) > runner.num_blocks:
        raise ValueError(f"{batch} x {context} tokens do not fit {runner.num_blocks} blocks")
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    seqs = [
        ScheduledSeq([100 + i], context, list(range(i * per_seq, (i + 1) * per_seq)), True, greedy, None)
        for i in range(batch)
    ]
    sync = (lambda: torch.cuda.synchronize(runner.device)) if runner.device.type == "cuda" else (lambda: None)
    for _ in range(2):
        runner.execute(seqs)
    times, cpu_times = [], []
    for _ in range(steps):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(seqs)
        sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu_times)


# the prompt chunk of the mixed step (tokens)
MIXED_PREFILL_TOKENS = 512


def time_mixed_step(
    runner: Any, decode: int, prefill: int, context: int, steps: int = 6, chunks: int = 1
) -> float:
    """Median wall seconds of a mixed step as chunked prefill schedules it: `decode` sequences
    decoding one token over `context` cached tokens plus `prefill` prompt tokens as `chunks`
    fresh prompts of equal length (a burst of new requests), packed into one forward (graphs
    never cover it: it runs eager)."""
    from services.worker.engine.api import SamplingConfig
    from services.worker.engine.model_runner import ScheduledSeq

    bs = runner.layout.block_size
    per_seq = -(-(context + 1) // bs)
    if chunks < 1 or prefill % chunks:
        raise ValueError(f"{prefill} prompt tokens do not split into {chunks} equal prompts")
    chunk_blocks = -(-(prefill // chunks) // bs)
    if step_blocks(bs, decode, context, prefill, chunks) > runner.num_blocks:
        raise ValueError(f"{decode} x {context} + {prefill} tokens do not fit {runner.num_blocks} blocks")
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    seqs = [
        ScheduledSeq([100 + i], context, list(range(i * per_seq, (i + 1) * per_seq)), True, greedy, None)
        for i in range(decode)
    ]
    for c in range(chunks):
        first = decode * per_seq + c * chunk_blocks
        table = list(range(first, first + chunk_blocks))
        seqs.append(ScheduledSeq([7 + c] * (prefill // chunks), 0, table, True, greedy, None))
    cuda = runner.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(runner.device)) if cuda else (lambda: None)
    for _ in range(2 if cuda else 1):
        runner.execute(seqs)
    times = []
    for _ in range(steps if cuda else 3):  # on a CPU one such step takes ~1.5 s
        sync()
        t0 = time.perf_counter()
        runner.execute(seqs)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mixed_row(
    runner: Any,
    model: Any,
    bandwidth: float,
    flops: float,
    decode: int,
    prefill: int,
    context: int,
    chunks: int = 1,
) -> dict[str, Any]:
    """One mixed step against its roofline: the max of reading the weights and the decode rows'
    KV once, and the FLOPs of every row (prefill rows attend to about half their chunk)."""
    step = time_mixed_step(runner, decode, prefill, context, chunks=chunks)
    kv_per_token = runner.bytes_per_block // runner.layout.block_size
    read = weight_bytes_per_step(model, decode + prefill) + decode * (context + 1) * kv_per_token
    work = flops_per_step(model, decode, context) + flops_per_step(model, prefill, prefill // chunks // 2)
    roofline = max(read / bandwidth, work / flops)
    return {
        "decode_seqs": decode,
        "prefill_tokens": prefill,
        "prefill_prompts": chunks,
        "step_ms": round(step * 1e3, 2),
        "roofline_ms": round(roofline * 1e3, 2),
        "vs_roofline": round(step / roofline, 2),
    }


def time_async_decode_steps(runner: Any, batch: int, context: int, steps: int = 16) -> float:
    """Wall seconds per pure decode step in a pipelined loop, as the engine's async scheduling
    runs them (ModelRunner.execute_async): step k+1 is queued, its input ids taken from step
    k's draws on the device, before step k's ids are read back. The same sequences as
    `time_decode_steps` (each step rewrites the same slot)."""
    from services.worker.engine.api import SamplingConfig
    from services.worker.engine.model_runner import ScheduledSeq

    bs = runner.layout.block_size
    per_seq = -(-(context + 1) // bs)
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    seqs = [
        ScheduledSeq([100 + i], context, list(range(i * per_seq, (i + 1) * per_seq)), True, greedy, None)
        for i in range(batch)
    ]
    for _ in range(2):
        runner.execute_async(seqs).tokens()
    t0 = time.perf_counter()
    pending = runner.execute_async(seqs)
    for _ in range(steps - 1):
        queued = runner.execute_async(seqs, pending.ids)
        pending.tokens()
        pending = queued
    pending.tokens()
    return (time.perf_counter() - t0) / steps


def measure(
    model_path: str,
    device_name: str,
    dtype_name: str,
    threads: int,
    batches: tuple[int, ...] = (1, 8, 16),
    context: int = 320,
    block_size: int = 16,
) -> dict[str, Any]:
    """The whole probe (run in its own process: it sets torch's thread count)."""
    from services.worker.engine import cpu_kernels
    from services.worker.engine.api import EngineConfig
    from services.worker.engine.backend import ModelBackend
    from services.worker.engine.model_loading import kv_layout_of, load_model, resolve_dtype
    from services.worker.engine.model_runner import ModelRunner
    from services.worker.engine.options import BackendOptions

    device = torch.device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    # the first call in a process builds the C++ kernels (cold: ~25 s) or loads the cached build
    t0 = time.perf_counter()
    kernels = cpu_kernels.available()
    out: dict[str, Any] = {
        "cpu": cpu_features(),
        "context_tokens": context,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "cpu_kernels": {"available": kernels, "load_s": round(time.perf_counter() - t0, 2)},
    }
    all_threads = torch.get_num_threads()
    # The floor takes the faster of torch's pages and huge pages (where the OS grants them, a
    # one-core read was ~27 % faster on the EPYC): the engine keeps its weights and KV on huge
    # pages, and a floor it could beat would flatter it.
    small = read_bandwidth(1)
    huge = read_bandwidth(1, huge_pages=True)
    single = max(small, huge)
    out["bandwidth_gb_s"] = {
        "single_core": round(single / 1e9, 2),
        "single_core_small_pages": round(small / 1e9, 2),
        "single_core_huge_pages": round(huge / 1e9, 2),
        "all_cores": round(read_bandwidth(all_threads, huge_pages=True) / 1e9, 2),
        "all_core_threads": all_threads,
    }
    if device.type == "cuda":
        bandwidth = cuda_bandwidth(device)
        out["bandwidth_gb_s"]["device"] = round(bandwidth / 1e9, 2)
    else:
        bandwidth = single
    torch.set_num_threads(threads if threads > 0 else 1)
    out["step_threads"] = torch.get_num_threads()
    # on a GPU in the model's dtype and big enough to fill the device (a 1024^3 fp32 product
    # read 28.7 TFLOP/s on an H200 that does ~790 in bf16)
    flops = gemm_flops(device, 8192, dtype=dtype) if device.type == "cuda" else gemm_flops(device)
    out["gemm_gflop_s"] = round(flops / 1e9, 1)
    t0 = time.perf_counter()
    # the engine's defaults: oneDNN-packed weights and, in fp32, their panel copy for <= 16 rows
    model = load_model(model_path, device, dtype, row_copy=EngineConfig.cpu_row_copy)
    out["cpu_row_copy"] = any(getattr(m, "row_weight", None) is not None for m in model.modules())
    layout = kv_layout_of(model.config, block_size, dtype)
    per_seq_blocks = -(-(context + 1) // block_size)
    # room for the largest decode batch and the mixed step's prompt chunk
    pool_blocks = max(batches) * per_seq_blocks + 1 + -(-MIXED_PREFILL_TOKENS // block_size)
    runner = ModelRunner(model, layout, pool_blocks, device, dtype)
    runner.warm_up()
    out["runner_start_s"] = round(time.perf_counter() - t0, 2)
    kv_per_token = runner.bytes_per_block // block_size
    rows = []
    for batch in batches:
        step, step_cpu = time_decode_steps(runner, batch, context)
        w = weight_bytes_per_step(model, batch)
        kv = batch * (context + 1) * kv_per_token
        floor = (w + kv) / bandwidth
        roofline = max(floor, flops_per_step(model, batch, context) / flops)
        rows.append(
            {
                "seqs": batch,
                "step_ms": round(step * 1e3, 2),
                "step_cpu_ms": round(step_cpu * 1e3, 2),
                "floor_ms": round(floor * 1e3, 2),
                "vs_floor": round(step / floor, 2),
                "cpu_vs_floor": round(step_cpu / floor, 2),
                "roofline_ms": round(roofline * 1e3, 2),
                "vs_roofline": round(step / roofline, 2),
                "weight_mb": round(w / 1e6, 1),
                "kv_mb": round(kv / 1e6, 1),
            }
        )
    out["steps"] = rows
    # a mixed prefill + decode step (chunked prefill): 8 (or fewer) decoding sequences and a
    # 512-token chunk, eager; on CUDA the default backend's (graphs cannot hold it), measured
    # below on that backend's runner

    def mixed(on: Any) -> dict[str, Any]:
        try:
            return mixed_row(on, model, bandwidth, flops, min(8, max(batches)), MIXED_PREFILL_TOKENS, context)
        except ValueError as e:  # a pool too small for it
            return {"skipped": str(e)}

    if device.type != "cuda":
        out["mixed_step"] = mixed(runner)
    if out["cpu_row_copy"]:
        # the same 1- to 8-sequence steps on oneDNN's kernel alone (--no-cpu-row-copy), same run
        for mod in model.modules():
            if getattr(mod, "row_weight", None) is not None:
                mod.row_weight = None
        plain = ModelRunner(model, layout, pool_blocks, device, dtype)
        ab = []
        for batch in (b for b in (1, 2, 4, 8, 16) if b <= max(batches)):  # what the pools hold
            with_copy, _ = time_decode_steps(runner, batch, context)
            without, _ = time_decode_steps(plain, batch, context)
            ab.append(
                {
                    "seqs": batch,
                    "with_row_copy_ms": round(with_copy * 1e3, 2),
                    "without_ms": round(without * 1e3, 2),
                    "speedup": round(without / with_copy, 2),
                }
            )
        out["row_copy_steps"] = ab
    if device.type == "cuda":
        # the same steps replayed as CUDA graphs (engine/decode_graphs.py), same pool size: the
        # default (fused layers, attention in place) and the torch-only path (--no-cuda-kernels)
        for key, fused in (("steps_cuda_graphs", None), ("steps_cuda_graphs_torch_path", False)):
            graphs = ModelRunner(
                model,
                layout,
                pool_blocks,
                device,
                dtype,
                backend=ModelBackend.choose(BackendOptions(cuda_kernels=fused is not False), device),
            )
            graph_rows = []
            for batch, r in zip(batches, rows, strict=True):
                step, step_cpu = time_decode_steps(graphs, batch, context)
                pipelined = time_async_decode_steps(graphs, batch, context)
                graph_rows.append(
                    {
                        "seqs": batch,
                        "step_ms": round(step * 1e3, 3),
                        "step_cpu_ms": round(step_cpu * 1e3, 2),
                        "vs_floor": round(step * 1e3 / r["floor_ms"], 2),
                        # per step in async scheduling's pipelined loop (--async-scheduling)
                        "async_step_ms": round(pipelined * 1e3, 3),
                    }
                )
            out[key] = graph_rows
            if fused is None:
                out["mixed_step"] = mixed(graphs)
            del graphs
            torch.cuda.empty_cache()
    eight = next((r for r in rows if r["seqs"] == 8), None)
    out["decode_step_vs_floor"] = eight["vs_floor"] if eight else None
    out["decode_step_vs_roofline"] = eight["vs_roofline"] if eight else None
    return out


def format_report(probe: dict[str, Any]) -> list[str]:
    cpu = probe["cpu"]
    bw = probe["bandwidth_gb_s"]
    isa = ", ".join(k for k in ("avx2", "avx512f", "avx512_bf16", "amx") if cpu.get(k))
    lines = [
        f"machine: {cpu['model']}, {cpu['cpus']} CPUs, torch {cpu['torch']} capability "
        f"{cpu['torch_cpu_capability']} (flags: {isa or 'none'}; oneDNN bf16 "
        f"{'yes' if cpu['onednn_bf16'] else 'no'})"
        + (f", emulated by {cpu['isa_env']}" if cpu["isa_env"] else ""),
        f"memory read bandwidth: {bw['single_core']:.1f} GB/s one core"
        + (
            f" ({bw['single_core_small_pages']:.1f} on 4 KiB pages, "
            f"{bw['single_core_huge_pages']:.1f} on huge pages)"
            if "single_core_huge_pages" in bw
            else ""
        )
        + f", {bw['all_cores']:.1f} "
        f"GB/s with {bw['all_core_threads']} threads"
        + (f", {bw['device']:.0f} GB/s device" if "device" in bw else ""),
        f"{'fp32' if probe.get('device', 'cpu') == 'cpu' else probe['dtype']} GEMM: "
        f"{probe['gemm_gflop_s']:.0f} GFLOP/s with {probe['step_threads']} thread(s)",
        *(
            [
                "CPU kernels (engine/cpu_kernels.py): "
                + (
                    f"built or loaded in {probe['cpu_kernels']['load_s']:.1f} s"
                    if probe["cpu_kernels"]["available"]
                    else "unavailable (no compiler?): fallback kernels"
                )
            ]
            if "cpu_kernels" in probe
            else []
        ),
        f"decode step of one rank ({probe['step_threads']} thread(s), {probe['context_tokens']} "
        f"cached tokens per sequence) vs its floor (weights + KV read once) and roofline "
        f"(max of that and FLOPs / GEMM rate):",
    ]
    for r in probe["steps"]:
        lines.append(
            f"  {r['seqs']:>3} seqs: {r['step_ms']:7.1f} ms wall ({r['step_cpu_ms']:.1f} "
            f"ms CPU), floor {r['floor_ms']:5.1f} ms ({r['weight_mb']:.0f} MB weights"
            f" + {r['kv_mb']:.0f} MB KV): {r['vs_floor']:.2f}x "
            f"({r['cpu_vs_floor']:.2f}x by CPU time)"
        )
    for a in probe.get("row_copy_steps", []):
        lines.append(
            f"  {a['seqs']:>3} seqs: {a['with_row_copy_ms']:.1f} ms with the row copy, "
            f"{a['without_ms']:.1f} ms without (--no-cpu-row-copy): {a['speedup']:.2f}x"
        )
    m = probe.get("mixed_step")
    if m and "step_ms" in m:
        lines.append(
            f"  mixed step ({m['decode_seqs']} decoding + a {m['prefill_tokens']}-token prefill chunk, "
            f"eager): {m['step_ms']:.1f} ms, roofline {m['roofline_ms']:.1f} ms: {m['vs_roofline']:.2f}x"
        )
    for g in probe.get("steps_cuda_graphs", []):
        lines.append(
            f"  {g['seqs']:>3} seqs as a CUDA graph: {g['step_ms']:7.2f} ms wall "
            f"({g['step_cpu_ms']:.2f} ms CPU): {g['vs_floor']:.2f}x its floor"
            + (f"; pipelined (async scheduling) {g['async_step_ms']:.2f} ms" if "async_step_ms" in g else "")
        )
    return lines
