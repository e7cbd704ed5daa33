"""Stack benchmarks (DESIGN "Speed is measured"): in one run on the bundled SmolLM2, CPU fp32,
one torch thread per worker:

(a) KV transfer time vs prefill time, per transport: per prompt length, a prefill worker runs
    the prompt and hands its KV to a decode worker over gRPC (PushKv chunks) or NIXL (the decode
    worker READs the prefill worker's blocks); the worker's own timings
    (PrefillResponse.prefill_ns / kv_transfer_ns / kv_bytes_sent) give the ratio. kv_transfer_ns
    is the whole handoff as the prefill worker sees it (for NIXL: the PushKv round trip that
    carries the descriptors, the decode side's READ and its answer), after the prefill: for the
    gRPC push of a prompt prefilled in several chunks (longer than --max-batch-tokens, 512 on
    CPU) the blocks of all but the last chunk went during the prefill, so only the rest counts.
(b) TTFT through the gateway (streaming, one request at a time) at 512 and 2,048 prompt tokens:
    disaggregated over NIXL, disaggregated over the gRPC push (workers with --kv-transport grpc)
    and unified (one worker), as ratios disaggregated / unified.
(c) End-to-end stack overhead vs the in-process engine: the same greedy requests, one at a time,
    through gateway -> scheduler -> prefill -> KV handoff -> decode, and through the engine
    called in process; prints the wall-time ratio.

    python -m benchmarks.bench_stack [--quick]     (make bench-stack)

Writes benchmarks/results/stack.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from services.worker.engine import create_engine
from services.worker.engine.api import EngineConfig, EngineRequest, SamplingConfig
from shared.model_store import resolve_model
from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.stack import running_stack

RESULTS = Path(__file__).parent / "results" / "stack.json"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prompt(n: int, salt: int) -> list[int]:
    # Distinct token ids per run so no prefix-cache hit shortens a prefill (ids < 49152 vocab).
    return [1000 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


async def kv_vs_prefill(
    prefill: str,
    decode: str,
    lengths: list[int],
    reps: int,
    metadata: Sequence[tuple[str, str]] = (),
    transports: Sequence[str] = ("grpc", "nixl"),
) -> list[dict[str, object]]:
    """`metadata`: the cluster token the stack's internal RPCs require (Stack.internal_metadata);
    `transports`: "grpc" (KvTarget without kv_transport) and/or "nixl", alternated per repetition
    so that both see the same machine load."""
    rows: list[dict[str, object]] = []
    want_pb = {"grpc": worker_pb2.KV_TRANSPORT_GRPC_PUSH, "nixl": worker_pb2.KV_TRANSPORT_NIXL}
    async with grpc.aio.insecure_channel(prefill) as pch, grpc.aio.insecure_channel(decode) as dch:
        p, d = worker_pb2_grpc.WorkerStub(pch), worker_pb2_grpc.WorkerStub(dch)
        # 2 tokens: the request continues on the decode worker, so its KV is handed over
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0, top_p=1, ignore_eos=True)
        for n in lengths:
            prefill_ms: dict[str, list[float]] = {t: [] for t in transports}
            transfer_ms: dict[str, list[float]] = {t: [] for t in transports}
            mib: dict[str, float] = {}
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
                    reply = await p.Prefill(
                        worker_pb2.PrefillRequest(
                            request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_target=target
                        ),
                        metadata=metadata,
                    )
                    stream.cancel()
                    await d.Abort(worker_pb2.AbortRequest(request_id=rid), metadata=metadata)
                    if reply.kv_transport != want_pb[transport]:
                        raise RuntimeError(
                            f"asked for {transport}, the prefill worker used {reply.kv_transport}"
                        )
                    if r:
                        prefill_ms[transport].append(reply.prefill_ns / 1e6)
                        transfer_ms[transport].append(reply.kv_transfer_ns / 1e6)
                        mib[transport] = reply.kv_bytes_sent / 2**20
            for transport in transports:
                prefill_med = statistics.median(prefill_ms[transport])
                transfer_med = statistics.median(transfer_ms[transport])
                row: dict[str, object] = {
                    "transport": transport,
                    "prompt_tokens": n,
                    "prefill_ms": round(prefill_med, 2),
                    "kv_transfer_ms": round(transfer_med, 3),
                    "kv_transfer_ms_all": [round(t, 3) for t in transfer_ms[transport]],
                    "kv_mib": round(mib[transport], 2),
                    "kv_gib_per_s": round(mib[transport] / 1024 / (transfer_med / 1e3), 2)
                    if transfer_med
                    else None,
                    "transfer_over_prefill": round(transfer_med / prefill_med, 4),
                }
                rows.append(row)
                print(
                    f"  {transport:4s} prompt {n:5d} tokens: prefill {prefill_med:8.1f} ms, "
                    f"KV handoff {transfer_med:7.1f} ms ({mib[transport]:.1f} MiB) = "
                    f"{100 * transfer_med / prefill_med:.2f} % of prefill",
                    flush=True,
                )
    return rows


async def ttft_ms(gateways: dict[str, str], lengths: list[int], reps: int) -> dict[str, dict[int, float]]:
    """Median time to the first streamed frame per configuration and prompt length, one request
    at a time, the configurations alternated per repetition (same machine load for each)."""
    times: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in gateways}
    channels = {c: grpc.aio.insecure_channel(g) for c, g in gateways.items()}
    try:
        for n in lengths:
            for r in range(reps + 1):  # the first round warms each stack up at this length
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
                    while await call.read() is not grpc.aio.EOF:
                        pass
                    if r:
                        times[config][n].append(elapsed_ms)
    finally:
        for ch in channels.values():
            await ch.close()
    return {c: {n: statistics.median(v) for n, v in per.items()} for c, per in times.items()}


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


async def in_process(model: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    engine = create_engine(
        EngineConfig(
            model_path=str(model), device="cpu", dtype="float32", torch_threads=1, kv_cache_tokens=8192
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


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    model = resolve_model("default")
    lengths = [64, 256] if args.quick else [128, 512, 2048]
    ttft_lengths = [64, 256] if args.quick else [512, 2048]
    reps = 1 if args.quick else 3
    n_requests, new_tokens = (2, 8) if args.quick else (8, 32)
    prompts = [_prompt(128, 5000 + i) for i in range(n_requests)]
    with contextlib.ExitStack() as stacks:
        logs = Path(stacks.enter_context(tempfile.TemporaryDirectory()))
        disagg = stacks.enter_context(running_stack("default", _mkdir(logs / "nixl")))
        assert disagg.prefill and disagg.decode
        print("(a) KV transfer vs prefill (disaggregated workers over loopback)", flush=True)
        rows = await kv_vs_prefill(disagg.prefill, disagg.decode, lengths, reps, disagg.internal_metadata)
        print(f"(c) {n_requests} requests x {new_tokens} tokens, one at a time", flush=True)
        stack_s, stack_out = await through_stack(disagg.gateway, prompts, new_tokens)
        grpc_only = stacks.enter_context(
            running_stack("default", _mkdir(logs / "grpc"), worker_args=["--kv-transport", "grpc"])
        )
        unified = stacks.enter_context(running_stack("default", _mkdir(logs / "unified"), unified=True))
        print("(b) TTFT, one request at a time (the three stacks alternated)", flush=True)
        ttft = await ttft_ms(
            {
                "disaggregated_nixl": disagg.gateway,
                "disaggregated_grpc": grpc_only.gateway,
                "unified": unified.gateway,
            },
            ttft_lengths,
            reps,
        )
    ttft_rows = []
    for n in ttft_lengths:
        uni = ttft["unified"][n]
        ttft_row = {
            "prompt_tokens": n,
            "unified_ms": round(uni, 1),
            "disaggregated_nixl_ms": round(ttft["disaggregated_nixl"][n], 1),
            "disaggregated_grpc_ms": round(ttft["disaggregated_grpc"][n], 1),
            "nixl_over_unified": round(ttft["disaggregated_nixl"][n] / uni, 3),
            "grpc_over_unified": round(ttft["disaggregated_grpc"][n] / uni, 3),
        }
        ttft_rows.append(ttft_row)
        print(
            f"  prompt {n:5d} tokens: TTFT unified {uni:8.1f} ms, disaggregated NIXL "
            f"{ttft_row['disaggregated_nixl_ms']:8.1f} ms ({ttft_row['nixl_over_unified']:.3f}x), gRPC "
            f"{ttft_row['disaggregated_grpc_ms']:8.1f} ms ({ttft_row['grpc_over_unified']:.3f}x)",
            flush=True,
        )
    engine_s, engine_out = await in_process(model, prompts, new_tokens)
    identical = stack_out == engine_out
    overhead = stack_s / engine_s
    print(
        f"  through the stack: {stack_s:6.2f} s   in-process engine: {engine_s:6.2f} s   "
        f"ratio {overhead:.2f}   tokens identical: {identical}",
        flush=True,
    )
    return {
        "kv_vs_prefill": rows,
        "ttft": ttft_rows,
        "stack_overhead": {
            "requests": n_requests,
            "new_tokens": new_tokens,
            "stack_s": round(stack_s, 3),
            "in_process_s": round(engine_s, 3),
            "ratio_stack_over_engine": round(overhead, 3),
            "tokens_identical": identical,
        },
        "config": {
            "model": "default",
            "device": "cpu",
            "dtype": "float32",
            "threads_per_worker": 1,
            "quick": args.quick,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    from benchmarks.engine_floor import cpu_features

    # torch version, torch.backends.cpu.get_cpu_capability(), cpus, ISA flags
    result["machine"] = cpu_features() | {"load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    out = RESULTS.with_name("stack-quick.json") if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
