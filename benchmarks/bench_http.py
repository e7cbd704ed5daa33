"""HTTP vs gRPC streaming through the same gateway, in one run: the bundled SmolLM2 on CPU (fp32,
one torch thread per worker, disaggregated `pdserve up`), the same greedy requests streamed through
`pdserve.v1.Gateway/Generate` (grpc.aio) and `POST /v1/completions` with `stream: true` (httpx,
server-sent events), one at a time, the two faces alternating (ABBA) so drift hits both alike.

Per request: TTFT = first frame / event carrying text, from sending the request; TPOT = (time of
the last frame - time of the first) / (completion_tokens - 1). Prints the median of each per face
and the HTTP/gRPC ratios (target: HTTP TPOT within 1.05x of gRPC's).

    python -m benchmarks.bench_http [--quick]     (make bench-http)

Writes benchmarks/results/http.json (http-quick.json with --quick), with the machine it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.stack import running_stack

RESULTS = Path(__file__).parent / "results" / "http.json"


def _prompt(n: int, salt: int) -> list[int]:
    # Distinct token ids per request so that no prefix-cache hit shortens one face's prefill.
    return [1000 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


def machine() -> dict[str, Any]:
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
    }


async def grpc_stream(
    stub: gateway_pb2_grpc.GatewayStub, ids: list[int], new_tokens: int
) -> dict[str, float]:
    req = gateway_pb2.GenerateRequest(
        prompt_token_ids=ids, max_tokens=new_tokens, temperature=0, ignore_eos=True
    )
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async for frame in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        if frame.text and not first:
            first = now
        last = now
        if frame.HasField("usage"):
            tokens = frame.usage.completion_tokens
    return {"ttft_s": first - t0, "tpot_s": (last - first) / max(1, tokens - 1), "tokens": tokens}


async def http_stream(http: httpx.AsyncClient, ids: list[int], new_tokens: int) -> dict[str, float]:
    body = {
        "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                continue  # the usage chunk follows the last text chunk
            if chunk["choices"] and chunk["choices"][0]["text"] and not first:
                first = now
            last = now
    return {"ttft_s": first - t0, "tpot_s": (last - first) / max(1, tokens - 1), "tokens": tokens}


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {
        "ttft_ms_median": round(1000 * statistics.median(r["ttft_s"] for r in rows), 2),
        "tpot_ms_median": round(1000 * statistics.median(r["tpot_s"] for r in rows), 3),
        "tpot_ms_mean": round(1000 * statistics.fmean(r["tpot_s"] for r in rows), 3),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rounds, new_tokens, prompt_tokens = (2, 8, 64) if args.quick else (8, 32, 128)
    host = machine()
    runs: dict[str, list[dict[str, float]]] = {"grpc": [], "http": []}
    with tempfile.TemporaryDirectory() as logs, running_stack("default", Path(logs)) as stack:
        async with (
            grpc.aio.insecure_channel(stack.gateway) as channel,
            httpx.AsyncClient(base_url=stack.http_base_url.removesuffix("/v1"), timeout=600) as http,
        ):
            stub = gateway_pb2_grpc.GatewayStub(channel)
            # warm-up (not measured): both faces, and the model's first steps
            await grpc_stream(stub, _prompt(prompt_tokens, 1), 4)
            await http_stream(http, _prompt(prompt_tokens, 2), 4)
            for i in range(rounds):
                order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
                for j, face in enumerate(order):
                    ids = _prompt(prompt_tokens, 100 + 2 * i + j)
                    row = await (
                        grpc_stream(stub, ids, new_tokens)
                        if face == "grpc"
                        else http_stream(http, ids, new_tokens)
                    )
                    assert row["tokens"] == new_tokens, row
                    runs[face].append(row)
                    print(
                        f"  round {i} {face:4s}: TTFT {1000 * row['ttft_s']:7.1f} ms, "
                        f"TPOT {1000 * row['tpot_s']:6.2f} ms",
                        flush=True,
                    )
    faces = {face: summary(rows) for face, rows in runs.items()}
    ratios = {
        "ttft_http_over_grpc": round(faces["http"]["ttft_ms_median"] / faces["grpc"]["ttft_ms_median"], 3),
        "tpot_http_over_grpc": round(faces["http"]["tpot_ms_median"] / faces["grpc"]["tpot_ms_median"], 3),
    }
    for face, s in faces.items():
        ttft, tpot = s["ttft_ms_median"], s["tpot_ms_median"]
        print(f"{face:4s}: TTFT median {ttft:8.1f} ms   TPOT median {tpot:7.2f} ms")
    print(
        f"HTTP/gRPC: TTFT {ratios['ttft_http_over_grpc']:.3f}x   TPOT {ratios['tpot_http_over_grpc']:.3f}x "
        "(target TPOT <= 1.05x)"
    )
    return {
        "faces": faces,
        "ratios": ratios,
        "config": {
            "model": "default (SmolLM2-135M-Instruct)",
            "stack": "pdserve up, disaggregated (1 prefill + 1 decode worker)",
            "device": "cpu",
            "dtype": "float32",
            "threads_per_worker": 1,
            "rounds_per_face": rounds,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "clients": "grpc.aio Generate stream vs httpx SSE /v1/completions, same process, one at a time",
            "quick": args.quick,
        },
        "machine": host,
        "note": "taken on a shared machine other jobs were loading; ratios matter more than absolute times",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    out = RESULTS.with_name("http-quick.json") if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
