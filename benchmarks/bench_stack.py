"""Stack benchmarks (DESIGN "Speed is measured"), real `pdserve up` stacks on loopback. On CPU (the
default): the bundled SmolLM2, fp32, one torch thread per worker; on a GPU (`--device cuda`) any
model `resolve_model` knows, e.g. `--model random:llama-8b` (Llama-3-8B's shape, random weights
built on the device), each stack's workers sharing the one GPU (`pdserve up` splits
--gpu-memory-utilization between them; decode workers keep their CUDA graphs, prefill workers
capture none).

(a) KV transfer time vs prefill time, per transport: per prompt length, a prefill worker runs
    the prompt and hands its KV to a decode worker over gRPC (PushKv chunks) or NIXL (the decode
    worker READs the prefill worker's blocks); the worker's own timings
    (PrefillResponse.prefill_ns / kv_transfer_ns / kv_bytes_sent) give the ratio. kv_transfer_ns
    is the whole handoff as the prefill worker sees it (for NIXL: the PushKv round trip that
    carries the descriptors, the decode side's READ and its answer), after the prefill: for the
    gRPC push of a prompt prefilled in several chunks (longer than --max-batch-tokens, 512 on
    CPU) the blocks of all but the last chunk went during the prefill, so only the rest counts.
    NIXL rows also give the decode side's READ alone (`kv_read_ms`, from its
    pdserve_kv_transfer_read_seconds; the stacks run with --metrics): the rest of the handoff is
    the PushKv round trip and the answer.
(b) TTFT through the gateway (streaming, one request at a time) per prompt length: disaggregated
    over NIXL, disaggregated over the gRPC push (workers with --kv-transport grpc) and unified
    (one worker), as ratios disaggregated / unified, and each configuration's TTFT split as its
    gateway measured it (`phases_ms`: schedule, admit, prefill; from its
    pdserve_time_to_first_token_phase_seconds). On CPU the three stacks run together and are
    alternated per repetition (the same machine load for each); on a GPU they run one after the
    other (each `pdserve up` sizes its workers' memory for the whole GPU).
(c) End-to-end stack overhead vs the in-process engine: the same greedy requests, one at a time,
    through gateway -> scheduler -> prefill -> KV handoff -> decode, and through the engine
    called in process; prints the wall-time ratio. Not run on a GPU unless `--parts` names it
    (a second load of the model, in this process).

Every measurement starts with a warm-up round per prompt length (not counted): the first READ
from a peer connects, the first prefill of a shape compiles. The last lines print the ratios and
whether the targets of issue 27 are met (set for the 8B shape on a GPU at 2,048 tokens: the KV
handoff <= 5 % of the prefill, TTFT disaggregated <= 1.1x unified).

    python -m benchmarks.bench_stack [--quick]     (make bench-stack; writes results/stack.json)
    python -m benchmarks.bench_stack --device cuda --dtype bfloat16 --model random:llama-8b \\
        --lengths 2048 --reps 2                    (writes results/stack-cuda-<gpu>.json)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.result_names import gpu_tag
from services.up_shape import PORT_OFFSETS
from services.worker.engine import create_engine
from services.worker.engine.api import EngineConfig, EngineRequest, SamplingConfig
from shared.model_store import resolve_model
from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.stack import Stack, running_stack

RESULTS = Path(__file__).parent / "results"
TRANSPORTS = ("grpc", "nixl")  # the order (a) alternates them in
PARTS = ("a", "b", "c")
# issue 27's targets (8B shape on a GPU, at TARGET_TOKENS prompt tokens)
TARGET_TOKENS = 2048
TARGET_TRANSFER_OVER_PREFILL = 0.05
TARGET_TTFT_DISAGG_OVER_UNIFIED = 1.1


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prompt(n: int, salt: int) -> list[int]:
    # Distinct token ids per run so no prefix-cache hit shortens a prefill (ids < 49152 vocab).
    return [1000 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, with the defaults that depend on others filled in (lengths, reps, parts,
    transports as given: `available_transports` drops NIXL where it does not load)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small smoke run (64 and 256 tokens, 1 rep)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--model", default="default", help="'default' (bundled SmolLM2), a folder, or random:<shape>"
    )
    p.add_argument(
        "--lengths",
        type=_int_list,
        default=None,
        help="prompt lengths (tokens), comma-separated, of (a) and (b); default 512,2048 "
        "(on CPU (a) also measures 128)",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions per length (default 3, --quick 1)")
    p.add_argument(
        "--transports",
        default="nixl,grpc",
        help="KV transports measured, comma-separated (nixl only where nixl-cu13 loads)",
    )
    p.add_argument("--parts", default=None, help="which of a,b,c to run (default a,b,c on CPU, a,b on CUDA)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result file (default results/stack.json; on CUDA results/stack-cuda-<gpu>.json)",
    )
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="per stack start")
    a = p.parse_args(argv)
    a.transports = [t.strip() for t in a.transports.split(",") if t.strip()]
    a.parts = [x.strip() for x in (a.parts or ("a,b" if a.device == "cuda" else "a,b,c")).split(",")]
    for name, values, allowed in (("transports", a.transports, TRANSPORTS), ("parts", a.parts, PARTS)):
        if not values or not set(values) <= set(allowed):
            p.error(f"--{name} must name some of {','.join(allowed)}, got {','.join(values)}")
    if a.quick:
        kv_lengths = ttft_lengths = a.lengths or [64, 256]
    else:
        ttft_lengths = a.lengths or [512, 2048]
        kv_lengths = a.lengths or ([128, *ttft_lengths] if a.device == "cpu" else ttft_lengths)
    a.kv_lengths, a.ttft_lengths = kv_lengths, ttft_lengths
    a.reps = a.reps if a.reps is not None else (1 if a.quick else 3)
    if a.reps < 1 or min(kv_lengths) < 1:
        p.error("--reps and --lengths must be >= 1")
    a.command = shlex.join(
        ["python", "-m", "benchmarks.bench_stack", *(sys.argv[1:] if argv is None else argv)]
    )
    return a


def available_transports(wanted: Sequence[str]) -> list[str]:
    """`wanted` without NIXL where nixl-cu13 does not load here (the workers would then offer only
    the gRPC push: a "NIXL" stack would measure gRPC)."""
    from services.worker.kv_nixl import load_nixl

    if "nixl" in wanted and load_nixl() is None:
        print("NIXL does not load here (nixl-cu13): measuring the gRPC push only", flush=True)
        return [t for t in wanted if t != "nixl"]
    return list(wanted)


def stack_configs(a: argparse.Namespace, transports: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Configuration name -> running_stack keyword arguments (besides the log folder), in start
    order: the disaggregated stacks (NIXL: the workers' default transport, auto; gRPC: workers
    with --kv-transport grpc), then the unified one (only when (b) runs). `pdserve up` gets the
    device and dtype; its own defaults do the rest (the GPU memory split between workers, CUDA
    graphs on a decode worker only)."""
    up_args = ["--device", a.device, "--dtype", a.dtype]
    # metrics on: (a) reads the decode worker's NIXL READ time (pdserve_kv_transfer_read_seconds)
    common = {"up_args": up_args, "ready_timeout_s": a.ready_timeout_s, "metrics": True}
    configs: dict[str, dict[str, Any]] = {}
    for t in sorted(transports, key=lambda t: t != "nixl"):  # NIXL first, as (a) runs on it
        worker_args = ["--kv-transport", "grpc"] if t == "grpc" else []
        configs[f"disaggregated_{t}"] = {**common, "worker_args": worker_args}
    if "b" in a.parts:
        configs["unified"] = {**common, "unified": True}
    return configs


async def kv_vs_prefill(
    prefill: str,
    decode: str,
    lengths: list[int],
    reps: int,
    metadata: Sequence[tuple[str, str]] = (),
    transports: Sequence[str] = TRANSPORTS,
    decode_metrics: str = "",
) -> list[dict[str, object]]:
    """`metadata`: the cluster token the stack's internal RPCs require (Stack.internal_metadata);
    `transports`: "grpc" (KvTarget without kv_transport) and/or "nixl", alternated per repetition
    so that both see the same machine load. A transport the prefill worker did not use (NIXL
    asked, the gRPC push used) is a row with an "error", never a mislabelled time.
    `decode_metrics`: the decode worker's /metrics URL; NIXL rows then split the handoff into the
    decode side's READ (its wait included: pdserve_kv_transfer_read_seconds) and the rest."""
    rows: list[dict[str, object]] = []
    want_pb = {"grpc": worker_pb2.KV_TRANSPORT_GRPC_PUSH, "nixl": worker_pb2.KV_TRANSPORT_NIXL}
    async with grpc.aio.insecure_channel(prefill) as pch, grpc.aio.insecure_channel(decode) as dch:
        p, d = worker_pb2_grpc.WorkerStub(pch), worker_pb2_grpc.WorkerStub(dch)
        # 2 tokens: the request continues on the decode worker, so its KV is handed over
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0, top_p=1, ignore_eos=True)
        for n in lengths:
            prefill_ms: dict[str, list[float]] = {t: [] for t in transports}
            read_ms: list[float] = []  # NIXL: the decode worker's READ per repetition
            transfer_ms: dict[str, list[float]] = {t: [] for t in transports}
            mib: dict[str, float] = {}
            wrong: dict[str, str] = {}
            for r in range(reps + 1):  # round 0 warms up (the first READ from a peer connects)
                for k, transport in enumerate(transports):
                    rid = f"bench-{transport}-{n}-{r}"
                    # distinct per run: no prefix-cache hit on either worker
                    ids = _prompt(n, n * 100 + r * 10 + k)
                    stream = d.Decode(
                        worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling),
                        metadata=metadata,
                    )
                    admitted = await stream.read()
                    target = worker_pb2.KvTarget(
                        address=decode,
                        transfer_ticket=admitted.transfer_ticket,
                        skip_blocks=admitted.cached_blocks,
                    )
                    if transport == "nixl":
                        target.kv_transport = worker_pb2.KV_TRANSPORT_NIXL
                    read_before = await _read_seconds(decode_metrics)
                    reply = await p.Prefill(
                        worker_pb2.PrefillRequest(
                            request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_target=target
                        ),
                        metadata=metadata,
                    )
                    stream.cancel()
                    await d.Abort(worker_pb2.AbortRequest(request_id=rid), metadata=metadata)
                    if reply.kv_transport != want_pb[transport]:
                        used = worker_pb2.KvTransport.Name(reply.kv_transport)
                        wrong[transport] = f"asked for {transport}, the prefill worker used {used}"
                    elif r:
                        prefill_ms[transport].append(reply.prefill_ns / 1e6)
                        transfer_ms[transport].append(reply.kv_transfer_ns / 1e6)
                        mib[transport] = reply.kv_bytes_sent / 2**20
                        read_after = await _read_seconds(decode_metrics)
                        if transport == "nixl" and read_before is not None and read_after is not None:
                            read_ms.append((read_after - read_before) * 1e3)
            for transport in transports:
                if transport in wrong:
                    rows.append({"transport": transport, "prompt_tokens": n, "error": wrong[transport]})
                    print(f"  {transport:4s} prompt {n:5d} tokens: {wrong[transport]}", flush=True)
                    continue
                prefill_med = statistics.median(prefill_ms[transport])
                transfer_med = statistics.median(transfer_ms[transport])
                row: dict[str, object] = {
                    "transport": transport,
                    "prompt_tokens": n,
                    "prefill_ms": round(prefill_med, 2),
                    "prefill_ms_all": [round(t, 2) for t in prefill_ms[transport]],
                    "kv_transfer_ms": round(transfer_med, 3),
                    "kv_transfer_ms_all": [round(t, 3) for t in transfer_ms[transport]],
                    "kv_mib": round(mib[transport], 2),
                    "kv_gib_per_s": round(mib[transport] / 1024 / (transfer_med / 1e3), 2)
                    if transfer_med
                    else None,
                    "transfer_over_prefill": round(transfer_med / prefill_med, 4),
                }
                if transport == "nixl" and read_ms:
                    row["kv_read_ms"] = round(statistics.median(read_ms), 3)  # of the handoff above
                    row["kv_read_ms_all"] = [round(t, 3) for t in read_ms]
                rows.append(row)
                print(
                    f"  {transport:4s} prompt {n:5d} tokens: prefill {prefill_med:8.1f} ms, "
                    f"KV handoff {transfer_med:7.1f} ms ({mib[transport]:.1f} MiB) = "
                    f"{100 * transfer_med / prefill_med:.2f} % of prefill"
                    + (f" (the decode side's READ: {row['kv_read_ms']} ms)" if "kv_read_ms" in row else ""),
                    flush=True,
                )
    return rows


async def _read_seconds(metrics_url: str) -> float | None:
    """The decode worker's total NIXL READ time so far (seconds), or None (no URL, no answer)."""
    if not metrics_url:
        return None

    def scrape() -> float | None:
        try:
            with urllib.request.urlopen(metrics_url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        # one series per read path (nixl, cuda_ipc); 0 before the first read
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("pdserve_kv_transfer_read_seconds_sum")
        )

    return await asyncio.to_thread(scrape)


async def ttft_ms(
    gateways: dict[str, str],
    lengths: list[int],
    reps: int,
    metrics: dict[str, str] | None = None,
    phases: dict[str, dict[int, dict[str, float]]] | None = None,
    second: dict[str, dict[int, float]] | None = None,
) -> dict[str, dict[int, float]]:
    """Median time to the first streamed frame per configuration and prompt length, one request
    at a time, the configurations alternated per repetition (same machine load for each). With
    `metrics` (configuration -> its gateway's /metrics URL), `phases` gets per configuration and
    length the mean ms of each phase of those requests' TTFT as the gateway split it
    (pdserve_time_to_first_token_phase_seconds: schedule, admit, prefill). `second` gets the
    median time to the second token (the next frame): where a disaggregated request's first
    token went out before its KV handoff ended (--first-token-before-handoff), the handoff's
    time shows there, not in the TTFT."""
    times: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in gateways}
    seconds: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in gateways}
    channels = {c: grpc.aio.insecure_channel(g) for c, g in gateways.items()}
    try:
        for n in lengths:
            before: dict[str, dict[str, tuple[float, float]]] = {}
            for r in range(reps + 1):  # the first round warms each stack up at this length
                if r == 1 and metrics:
                    before = await asyncio.to_thread(_ttft_phase_totals, metrics)
                for k, (config, ch) in enumerate(channels.items()):
                    ids = _prompt(n, 20000 + n * 10 + r * 3 + k)
                    t0 = time.perf_counter()
                    call = gateway_pb2_grpc.GatewayStub(ch).Generate(
                        gateway_pb2.GenerateRequest(
                            prompt_token_ids=ids, max_tokens=2, temperature=0, ignore_eos=True
                        ),
                        timeout=300,
                    )
                    first = await call.read()
                    elapsed_ms = (time.perf_counter() - t0) * 1e3
                    assert first is not grpc.aio.EOF
                    frames = 1
                    while await call.read() is not grpc.aio.EOF:
                        frames += 1
                        if frames == 2 and r:
                            seconds[config][n].append((time.perf_counter() - t0) * 1e3)
                    if r:
                        times[config][n].append(elapsed_ms)
            if metrics and phases is not None:
                await asyncio.sleep(0.3)  # a request's figures are recorded as its stream ends
                after = await asyncio.to_thread(_ttft_phase_totals, metrics)
                for config in after:
                    phases.setdefault(config, {})[n] = ttft_phases_ms(before.get(config, {}), after[config])
    finally:
        for ch in channels.values():
            await ch.close()
    if second is not None:
        for c, per in seconds.items():
            second.setdefault(c, {}).update({n: statistics.median(v) for n, v in per.items() if v})
    return {c: {n: statistics.median(v) for n, v in per.items()} for c, per in times.items()}


def gateway_ttft_phases(urls: list[str]) -> dict[str, tuple[float, float]]:
    """The gateways' TTFT split so far, summed over them (pdserve_time_to_first_token_phase_seconds:
    schedule, admit, prefill): phase -> (seconds, requests). A gateway that does not answer adds
    nothing."""
    total: dict[str, list[float]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for phase, (seconds, count) in ttft_phase_totals(text).items():
            t = total.setdefault(phase, [0.0, 0.0])
            t[0] += seconds
            t[1] += count
    return {phase: (v[0], v[1]) for phase, v in total.items()}


def ttft_phases_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean ms per phase of the requests that got their first token between the two snapshots."""
    out = {}
    for phase, (seconds, count) in after.items():
        s0, c0 = before.get(phase, (0.0, 0.0))
        if count - c0 > 0:
            out[phase] = round((seconds - s0) / (count - c0) * 1e3, 2)
    return out


def _ttft_phase_totals(metrics: dict[str, str]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per configuration, its gateway's TTFT phases so far: phase -> (seconds, requests)."""
    return {config: gateway_ttft_phases([url]) for config, url in metrics.items()}


def ttft_phase_totals(text: str) -> dict[str, tuple[float, float]]:
    """A gateway's /metrics text -> its TTFT phases so far: phase -> (seconds, requests)."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pdserve_time_to_first_token_phase_seconds":
            continue
        for sample in family.samples:
            field = {"_sum": 0, "_count": 1}.get(sample.name.removeprefix(family.name))
            if field is not None:
                totals.setdefault(sample.labels["phase"], [0.0, 0.0])[field] += sample.value
    return {phase: (v[0], v[1]) for phase, v in totals.items()}


async def through_stack(
    gateway: str, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    outputs = []
    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        t0 = time.perf_counter()
        for ids in prompts:
            resp = await stub.Complete(
                gateway_pb2.GenerateRequest(
                    prompt_token_ids=ids,
                    max_tokens=new_tokens,
                    temperature=0,
                    ignore_eos=True,
                    return_token_ids=True,
                ),
                timeout=300,
            )
            outputs.append(list(resp.token_ids))
        return time.perf_counter() - t0, outputs


async def in_process(
    model: Path, prompts: list[list[int]], new_tokens: int, device: str = "cpu", dtype: str = "float32"
) -> tuple[float, list[list[int]]]:
    """The engine in this process, set up as the stack's decode worker is: one torch thread; on
    CUDA without graphs (`pdserve up` turns them off for workers that share the GPU)."""
    engine = create_engine(
        EngineConfig(
            model_path=str(model),
            device=device,
            dtype=dtype,
            torch_threads=1,
            kv_cache_tokens=8192,
            cuda_graphs=False,
        )
    )
    engine.start()
    try:
        outputs = []
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            handle = engine.add_request(
                EngineRequest(
                    request_id=f"inproc-{i}",
                    prompt_token_ids=tuple(ids),
                    sampling=SamplingConfig(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                )
            )
            tokens: list[int] = []
            async for out in handle:
                tokens.extend(out.new_token_ids)
            outputs.append(tokens)
        return time.perf_counter() - t0, outputs
    finally:
        engine.shutdown()


def ttft_rows(
    ttft: dict[str, dict[int, float]],
    lengths: list[int],
    transports: Sequence[str],
    phases: dict[str, dict[int, dict[str, float]]] | None = None,
    second: dict[str, dict[int, float]] | None = None,
) -> list[dict[str, Any]]:
    """Per prompt length: each measured configuration's TTFT (ms) and, with unified measured,
    `<transport>_over_unified`; with `phases`, `phases_ms` (configuration -> the gateway's split
    of its TTFT, mean ms per phase); with `second`, `second_token_ms` (configuration -> median
    time to the second token, ms)."""
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"prompt_tokens": n}
        split = {c: per[n] for c, per in (phases or {}).items() if per.get(n)}
        if split:
            row["phases_ms"] = split
        to_second = {c: round(per[n], 1) for c, per in (second or {}).items() if n in per}
        if to_second:
            row["second_token_ms"] = to_second
        uni = ttft.get("unified", {}).get(n)
        if uni is not None:
            row["unified_ms"] = round(uni, 1)
        for t in transports:
            disagg = ttft.get(f"disaggregated_{t}", {}).get(n)
            if disagg is None:
                continue
            row[f"disaggregated_{t}_ms"] = round(disagg, 1)
            if uni:
                row[f"{t}_over_unified"] = round(disagg / uni, 3)
        rows.append(row)
    return rows


def targets(
    kv_rows: list[dict[str, Any]], ttfts: list[dict[str, Any]], transports: Sequence[str]
) -> list[dict[str, Any]]:
    """Issue 27's targets at TARGET_TOKENS prompt tokens, for what this run measured. A transport
    that (a) found not in use (an "error" row) is judged on nothing: its stack's TTFT was not its."""
    out: list[dict[str, Any]] = []
    bad = {row["transport"] for row in kv_rows if "error" in row}

    def goal(target: str, transport: str, value: float, limit: float) -> dict[str, Any]:
        return {
            "target": target,
            "transport": transport,
            "prompt_tokens": TARGET_TOKENS,
            "value": value,
            "limit": limit,
            "met": value <= limit,
        }

    for row in kv_rows:
        if row["prompt_tokens"] == TARGET_TOKENS and "transfer_over_prefill" in row:
            out.append(
                goal(
                    "kv_transfer_over_prefill",
                    row["transport"],
                    row["transfer_over_prefill"],
                    TARGET_TRANSFER_OVER_PREFILL,
                )
            )
    for row in ttfts:
        for t in transports:
            value = row.get(f"{t}_over_unified")
            if row["prompt_tokens"] == TARGET_TOKENS and value is not None and t not in bad:
                out.append(goal("ttft_disaggregated_over_unified", t, value, TARGET_TTFT_DISAGG_OVER_UNIFIED))
    return out


def print_summary(doc: dict[str, Any]) -> None:
    """The TTFTs, every ratio, and each target met or not."""
    transports = doc["config"]["transports"]
    for row in doc["ttft"]:
        parts = [f"unified {row['unified_ms']:8.1f} ms"] if "unified_ms" in row else []
        parts += [
            f"disaggregated {t} {row[f'disaggregated_{t}_ms']:8.1f} ms"
            for t in transports
            if f"disaggregated_{t}_ms" in row
        ]
        print(f"  prompt {row['prompt_tokens']:5d} tokens: TTFT " + ", ".join(parts))
        for config, split in row.get("phases_ms", {}).items():
            print(f"    {config}: " + ", ".join(f"{p} {ms:.1f} ms" for p, ms in split.items()))
        if "second_token_ms" in row:
            to_second = ", ".join(f"{c} {ms:.1f} ms" for c, ms in row["second_token_ms"].items())
            print(f"    to the second token: {to_second}")
    print("ratios:")
    for row in doc["kv_vs_prefill"]:
        ratio = row.get("transfer_over_prefill")
        text = f"{100 * ratio:.2f} %" if ratio is not None else row.get("error")
        print(f"  KV transfer / prefill  {row['transport']:4s} {row['prompt_tokens']:5d} tokens: {text}")
    for row in doc["ttft"]:
        for t in transports:
            if f"{t}_over_unified" in row:
                ratio_text = f"{row[f'{t}_over_unified']:.3f}x"
                print(f"  TTFT disagg / unified  {t:4s} {row['prompt_tokens']:5d} tokens: {ratio_text}")
    for g in doc["targets"]:
        value = (
            f"{100 * g['value']:.2f} % <= {100 * g['limit']:g} %"
            if g["target"] == "kv_transfer_over_prefill"
            else f"{g['value']:.3f}x <= {g['limit']:g}x"
        )
        verdict = "met" if g["met"] else "NOT met"
        print(f"target {g['target']} ({g['transport']}, {g['prompt_tokens']} tokens): {value}: {verdict}")
    if doc["targets"]:
        print("(the targets are set for the 8B shape on a GPU)")
    for name, error in doc.get("errors", {}).items():
        print(f"error [{name}]: {error[-500:]}")
    sys.stdout.flush()


def out_path(a: argparse.Namespace, tag: str) -> Path:
    if a.out is not None:
        return Path(a.out)
    name = "stack" if a.device == "cpu" else f"stack-cuda-{tag}"
    return RESULTS / f"{name}{'-quick' if a.quick else ''}.json"


def machine(device: str) -> dict[str, Any]:
    """The CPU (torch version, get_cpu_capability(), cpus, ISA flags) and, on CUDA, the GPU."""
    from benchmarks.engine_floor import cpu_features

    info: dict[str, Any] = cpu_features()
    if device == "cuda":
        import torch

        info |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    return info


@dataclass
class _Run:
    """One run: its settings and what it measured so far. On a GPU the result file is written
    after every stack, so that a run cut short (a stack that does not start, a timeout around
    the command) still leaves the numbers measured before."""

    a: argparse.Namespace
    transports: list[str]
    dtype: str
    together: bool  # the stacks run at once (CPU) or one after another (GPU)
    out: Path
    machine: dict[str, Any]
    t0: float = field(default_factory=time.perf_counter)
    kv_rows: list[dict[str, Any]] = field(default_factory=list)
    ttft: dict[str, dict[int, float]] = field(default_factory=dict)
    # configuration -> prompt length -> the gateway's split of TTFT (mean ms per phase)
    ttft_phases: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    # configuration -> prompt length -> median time to the second token (ms)
    second_token: dict[str, dict[int, float]] = field(default_factory=dict)
    start_s: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    overhead: dict[str, Any] | None = None

    def document(self) -> dict[str, Any]:
        a = self.a
        ttfts = (
            ttft_rows(self.ttft, a.ttft_lengths, self.transports, self.ttft_phases, self.second_token)
            if "b" in a.parts
            else []
        )
        errors = dict(self.errors)
        for row in self.kv_rows:
            if "error" in row:
                errors.setdefault(f"disaggregated_{row['transport']}", row["error"])
        doc: dict[str, Any] = {"kv_vs_prefill": self.kv_rows, "ttft": ttfts}
        if self.overhead is not None:
            doc["stack_overhead"] = self.overhead
        doc |= {
            "targets": targets(self.kv_rows, ttfts, self.transports),
            "config": {
                "model": a.model,
                "device": a.device,
                "dtype": self.dtype,
                "threads_per_worker": 1,
                "quick": a.quick,
                "reps": a.reps,
                "transports": self.transports,
                "parts": a.parts,
                "stacks": "alternated, all running" if self.together else "one after another",
            },
            "stack_start_s": self.start_s,
            "wall_s": round(time.perf_counter() - self.t0, 1),
            "command": a.command,
            "machine": self.machine | {"load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        }
        if errors:
            doc["errors"] = errors
        return doc

    def write(self, partial: bool = False) -> dict[str, Any]:
        doc = self.document() | ({"partial": True} if partial else {})
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(doc, indent=2) + "\n")
        return doc


async def main_async(a: argparse.Namespace, run: _Run) -> dict[str, Any]:
    path = resolve_model(a.model)
    configs = stack_configs(a, run.transports)
    first = next(iter(configs))  # (a) and (c) run on it: NIXL's stack offers both transports
    kv_transports = (
        [t for t in TRANSPORTS if t in run.transports] if first == "disaggregated_nixl" else ["grpc"]
    )
    if "b" not in a.parts:  # only the first stack is needed
        configs = {first: configs[first]}
    n_requests, new_tokens = (2, 8) if a.quick else (8, 32)
    prompts = [_prompt(128, 5000 + i) for i in range(n_requests)]
    stack_s, stack_out = 0.0, None

    async def measure(name: str, stack: Stack) -> None:
        nonlocal stack_s, stack_out
        if name != first:
            return
        assert stack.prefill and stack.decode
        if "a" in a.parts:
            print("(a) KV transfer vs prefill (disaggregated workers over loopback)", flush=True)
            run.kv_rows = await kv_vs_prefill(
                stack.prefill,
                stack.decode,
                a.kv_lengths,
                a.reps,
                stack.internal_metadata,
                kv_transports,
                stack.metrics_url(PORT_OFFSETS["decode-worker"]),
            )
        if "c" in a.parts:
            print(f"(c) {n_requests} requests x {new_tokens} tokens, one at a time", flush=True)
            stack_s, stack_out = await through_stack(stack.gateway, prompts, new_tokens)

    @contextlib.contextmanager
    def started(name: str, logs: Path) -> Iterator[Stack]:
        print(f"[{name}] starting", flush=True)
        t0 = time.perf_counter()
        with running_stack(str(path), _mkdir(logs / name), **configs[name]) as stack:
            run.start_s[name] = round(time.perf_counter() - t0, 1)
            yield stack

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        if run.together:
            with contextlib.ExitStack() as stacks:
                gateways, urls = {}, {}
                for name in configs:
                    stack = stacks.enter_context(started(name, logs))
                    await measure(name, stack)
                    gateways[name] = stack.gateway
                    urls[name] = stack.metrics_url(PORT_OFFSETS["gateway"])
                if "b" in a.parts:
                    print("(b) TTFT, one request at a time (the stacks alternated)", flush=True)
                    run.ttft = await ttft_ms(
                        gateways, a.ttft_lengths, a.reps, urls, run.ttft_phases, run.second_token
                    )
        else:
            for name in configs:
                try:
                    with started(name, logs) as stack:
                        await measure(name, stack)
                        if "b" in a.parts:
                            print(f"(b) TTFT, one request at a time: {name}", flush=True)
                            run.ttft |= await ttft_ms(
                                {name: stack.gateway},
                                a.ttft_lengths,
                                a.reps,
                                {name: stack.metrics_url(PORT_OFFSETS["gateway"])},
                                run.ttft_phases,
                                run.second_token,
                            )
                except (RuntimeError, grpc.aio.AioRpcError) as exc:  # the others still run
                    run.errors[name] = str(exc)[-3000:]
                    print(f"[{name}] failed: {run.errors[name][-2000:]}", flush=True)
                run.write(partial=True)
    if stack_out is not None:
        engine_s, engine_out = await in_process(path, prompts, new_tokens, a.device, run.dtype)
        identical = stack_out == engine_out
        overhead = stack_s / engine_s
        print(
            f"  through the stack: {stack_s:6.2f} s   in-process engine: {engine_s:6.2f} s   "
            f"ratio {overhead:.2f}   tokens identical: {identical}",
            flush=True,
        )
        run.overhead = {
            "requests": n_requests,
            "new_tokens": new_tokens,
            "stack_s": round(stack_s, 3),
            "in_process_s": round(engine_s, 3),
            "ratio_stack_over_engine": round(overhead, 3),
            "tokens_identical": identical,
        }
    return run.write()


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    transports = available_transports(a.transports)
    if not transports:
        raise SystemExit("bench_stack: no KV transport left to measure (NIXL does not load here)")
    info = machine(a.device)
    run = _Run(
        a=a,
        transports=transports,
        dtype=a.dtype if a.dtype != "auto" else ("float32" if a.device == "cpu" else "bfloat16"),
        together=a.device == "cpu",  # on a GPU each stack sizes its memory for the whole device
        out=out_path(a, gpu_tag(info.get("gpu", ""))),
        machine=info,
    )
    print(f"writing {run.out} ({a.command})", flush=True)
    doc = asyncio.run(main_async(a, run))
    print_summary(doc)
    print(f"wrote {run.out}")
    if "errors" in doc:
        sys.exit(1)


if __name__ == "__main__":
    main()
