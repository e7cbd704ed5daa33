"""The early gRPC push (kv_transfer.EarlyKvPush) on and off: a prefill worker and a decode worker
in this process (the bundled SmolLM2, CPU fp32, one torch thread each, --max-batch-tokens 512),
a prompt of --tokens (2,048: 4 prefill chunks) handed over by the gRPC push, rounds alternating
on / off (off: the whole KV after the prefill, as before the early push). Reported per mode, the
median over rounds after a warm-up of the handoff time the prefill worker still waits after its
last chunk (PrefillResponse.kv_transfer_ns), the prefill time and the Prefill call's wall time.

Both workers share this process's GIL and the machine's cores, so the decode side's imports
compete with the prefill: a lower bound on what separate processes or hosts gain.

    python -m benchmarks.bench_early_push [--tokens 2048] [--rounds 3]

Prints only (a ~1-minute run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from unittest import mock

import grpc

from services.worker.kv_transfer import GrpcKvSender
from shared.model_store import resolve_model
from shared.proto import common_pb2, worker_pb2
from tests.integration.worker.harness import RunningWorker, running_worker, worker_settings


async def _handoff(
    prefill: RunningWorker, decode: RunningWorker, rid: str, ids: list[int]
) -> tuple[float, float, float, float]:
    """(prefill ms, exposed handoff ms, KV MiB, Prefill call wall ms) of one request."""
    sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    stream = decode.stub.Decode(
        worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)
    )
    admitted = await stream.read()
    target = worker_pb2.KvTarget(
        address=decode.address, transfer_ticket=admitted.transfer_ticket, skip_blocks=admitted.cached_blocks
    )
    start = time.perf_counter()
    reply = await prefill.stub.Prefill(
        worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling, kv_target=target)
    )
    wall_ms = (time.perf_counter() - start) * 1e3
    while await stream.read() is not grpc.aio.EOF:
        pass
    return reply.prefill_ns / 1e6, reply.kv_transfer_ns / 1e6, reply.kv_bytes_sent / 2**20, wall_ms


async def main_async(args: argparse.Namespace) -> None:
    model = resolve_model("default")
    options = dict(
        block_size=16, kv_cache_tokens=4 * args.tokens, max_model_len=2 * args.tokens, max_batch_tokens=512
    )
    async with (
        running_worker(worker_settings(model, "prefill", kv_chunk_bytes=1 << 20, **options)) as prefill,
        running_worker(worker_settings(model, "decode", **options)) as decode,
    ):
        rows: dict[str, list[tuple[float, float, float, float]]] = {"on": [], "off": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            for k, mode in enumerate(rows):
                # distinct ids per request: no prefix-cache hit on either worker
                ids = [1000 + (r * 7919 + k * 17 + i * 31) % 40000 for i in range(args.tokens)]
                off = mock.patch.object(GrpcKvSender, "start_early", lambda *a, **kw: None)
                with off if mode == "off" else contextlib.nullcontext():
                    row = await _handoff(prefill, decode, f"{mode}-{r}", ids)
                if r:
                    rows[mode].append(row)
        for mode, got in rows.items():
            print(
                f"early push {mode:3s}: prompt {args.tokens} tokens ({got[0][2]:.1f} MiB): prefill "
                f"{statistics.median(g[0] for g in got):7.1f} ms, handoff after it "
                f"{statistics.median(g[1] for g in got):6.1f} ms, Prefill call "
                f"{statistics.median(g[3] for g in got):7.1f} ms (medians of {len(got)})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (512 per prefill chunk)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per mode")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
