"""Stack benchmarks (DESIGN "Speed is measured"): in one run on the bundled SmolLM2, CPU fp32,
one torch thread per worker:

(a) KV transfer time vs prefill time: per prompt length, a prefill worker runs the prompt and
    pushes its KV to a decode worker over gRPC (PushKv); the worker's own timings
    (PrefillResponse.prefill_ns / kv_transfer_ns / kv_bytes_sent) give the ratio.
(b) End-to-end stack overhead vs the in-process engine: the same greedy requests, one at a time,
    through gateway -> scheduler -> prefill -> KV push -> decode, and through the engine called
    in process; prints the wall-time ratio.

    python -m benchmarks.bench_stack [--quick]     (make bench-stack)

Writes benchmarks/results/stack.json.
"""

from __future__ import annotations

import argparse
import asyncio
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


def _prompt(n: int, salt: int) -> list[int]:
    # Distinct token ids per run so no prefix-cache hit shortens a prefill (ids < 49152 vocab).
    return [1000 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


async def kv_vs_prefill(
    prefill: str, decode: str, lengths: list[int], reps: int, metadata: Sequence[tuple[str, str]] = ()
) -> list[dict[str, float]]:
    """`metadata`: the cluster token the stack's internal RPCs require (Stack.internal_metadata)."""
    rows = []
    async with grpc.aio.insecure_channel(prefill) as pch, grpc.aio.insecure_channel(decode) as dch:
        p, d = worker_pb2_grpc.WorkerStub(pch), worker_pb2_grpc.WorkerStub(dch)
        # 2 tokens: the request continues on the decode worker, so its KV is pushed
        sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0, top_p=1, ignore_eos=True)
        for n in lengths:
            prefill_ms, transfer_ms, mib = [], [], 0.0
            for r in range(reps):
                rid = f"bench-{n}-{r}"
                ids = _prompt(n, n * 100 + r)
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
                reply = await p.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_target=target
                    ),
                    metadata=metadata,
                )
                stream.cancel()
                await d.Abort(worker_pb2.AbortRequest(request_id=rid), metadata=metadata)
                prefill_ms.append(reply.prefill_ns / 1e6)
                transfer_ms.append(reply.kv_transfer_ns / 1e6)
                mib = reply.kv_bytes_sent / 2**20
            row = {
                "prompt_tokens": n,
                "prefill_ms": statistics.median(prefill_ms),
                "kv_transfer_ms": statistics.median(transfer_ms),
                "kv_mib": round(mib, 2),
            }
            row["transfer_over_prefill"] = round(row["kv_transfer_ms"] / row["prefill_ms"], 4)
            rows.append(row)
            print(
                f"  prompt {n:5d} tokens: prefill {row['prefill_ms']:8.1f} ms, "
                f"KV push {row['kv_transfer_ms']:7.1f} ms"
                f" ({row['kv_mib']:.1f} MiB) = {100 * row['transfer_over_prefill']:.1f} % of prefill",
                flush=True,
            )
    return rows


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
    lengths = [64, 256] if args.quick else [64, 128, 256, 512, 1024]
    reps = 1 if args.quick else 3
    n_requests, new_tokens = (2, 8) if args.quick else (8, 32)
    prompts = [_prompt(128, 5000 + i) for i in range(n_requests)]
    with tempfile.TemporaryDirectory() as logs, running_stack("default", Path(logs)) as stack:
        assert stack.prefill and stack.decode
        print("(a) KV transfer vs prefill (disaggregated workers, gRPC PushKv over loopback)", flush=True)
        rows = await kv_vs_prefill(stack.prefill, stack.decode, lengths, reps, stack.internal_metadata)
        print(f"(b) {n_requests} requests x {new_tokens} tokens, one at a time", flush=True)
        stack_s, stack_out = await through_stack(stack.gateway, prompts, new_tokens)
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

    result["machine"] = cpu_features() | {"load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    out = RESULTS.with_name("stack-quick.json") if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
