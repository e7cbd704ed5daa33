"""HTTP vs gRPC streaming through the same gateway, in one run: the bundled SmolLM2 on CPU (fp32,
one torch thread per worker, disaggregated `pdserve up`), the same greedy requests streamed through
`pdserve.v1.Gateway/Generate` (grpc.aio) and `POST /v1/completions` with `stream: true` (httpx,
server-sent events), in two ways:

- sequential: one request at a time, the two faces alternating (ABBA) so drift hits both alike;
- paired: a gRPC and an HTTP request started together, so that they share every decode step (one
  batch on the decode worker): their TPOT differs only by what each face adds per token, and a
  loaded machine slows both alike. This is the comparison the target refers to.

Per request: TTFT = first frame / event carrying text, from sending the request; TPOT = (time of
the last frame - time of the first) / (completion_tokens - 1). Prints the median of each per face
and the HTTP/gRPC ratios (target: HTTP TPOT within 1.05x of gRPC's).

    python -m benchmarks.bench_http [--quick]     (make bench-http)

Writes benchmarks/results/http-<machine class>.json (http-cpu-avx2.json; -quick with --quick), with
the machine it ran on.
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

from benchmarks.result_names import result_path
from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.stack import running_stack


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


async def grpc_stream(stub: gateway_pb2_grpc.GatewayStub, ids: list[int], new_tokens: int) -> dict[str, Any]:
    req = gateway_pb2.GenerateRequest(
        prompt_token_ids=ids, max_tokens=new_tokens, temperature=0, ignore_eos=True
    )
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    times: list[float] = []  # arrival of each frame that carries text
    async for frame in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        if frame.text:
            times.append(now)
        if frame.text and not first:
            first = now
        last = now
        if frame.HasField("usage"):
            tokens = frame.usage.completion_tokens
    return {
        "ttft_s": first - t0,
        "tpot_s": (last - first) / max(1, tokens - 1),
        "tokens": tokens,
        "times": times,
    }


async def http_stream(http: httpx.AsyncClient, ids: list[int], new_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first = last = 0.0
    tokens = 0
    times: list[float] = []  # arrival of each event that carries text
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
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(now)
                first = first or now
            last = now
    return {
        "ttft_s": first - t0,
        "tpot_s": (last - first) / max(1, tokens - 1),
        "tokens": tokens,
        "times": times,
    }


def window_tpot(pair: tuple[dict[str, Any], dict[str, Any]]) -> tuple[float, float]:
    """Each face's time per text event while both streams were decoding (same decode steps)."""
    start = max(r["times"][0] for r in pair)
    end = min(r["times"][-1] for r in pair)
    out = []
    for r in pair:
        inside = [t for t in r["times"] if start <= t <= end]
        out.append((inside[-1] - inside[0]) / max(1, len(inside) - 1) if len(inside) > 1 else float("nan"))
    return out[0], out[1]


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "ttft_ms_median": round(1000 * statistics.median(r["ttft_s"] for r in rows), 2),
        "tpot_ms_median": round(1000 * statistics.median(r["tpot_s"] for r in rows), 3),
        "tpot_ms_mean": round(1000 * statistics.fmean(r["tpot_s"] for r in rows), 3),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rounds, new_tokens, prompt_tokens = (2, 12, 64) if args.quick else (8, 48, 128)
    host = machine()
    runs: dict[str, list[dict[str, Any]]] = {"grpc": [], "http": []}
    paired: dict[str, list[dict[str, Any]]] = {"grpc": [], "http": []}
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
                        f"  sequential {i} {face:4s}: TTFT {1000 * row['ttft_s']:7.1f} ms, "
                        f"TPOT {1000 * row['tpot_s']:6.2f} ms",
                        flush=True,
                    )
            for i in range(rounds):
                g_ids, h_ids = _prompt(prompt_tokens, 500 + 2 * i), _prompt(prompt_tokens, 501 + 2 * i)
                g, h = await asyncio.gather(
                    grpc_stream(stub, g_ids, new_tokens), http_stream(http, h_ids, new_tokens)
                )
                assert g["tokens"] == h["tokens"] == new_tokens, (g, h)
                g["tpot_s"], h["tpot_s"] = window_tpot((g, h))
                paired["grpc"].append(g)
                paired["http"].append(h)
                gt, ht = 1000 * g["tpot_s"], 1000 * h["tpot_s"]
                print(f"  paired {i}: TPOT (shared steps) gRPC {gt:6.2f} ms, HTTP {ht:6.2f} ms", flush=True)
    faces = {face: summary(rows) for face, rows in runs.items()}
    paired_faces = {face: summary(rows) for face, rows in paired.items()}
    ratios = {
        "ttft_http_over_grpc": round(faces["http"]["ttft_ms_median"] / faces["grpc"]["ttft_ms_median"], 3),
        "tpot_http_over_grpc": round(faces["http"]["tpot_ms_median"] / faces["grpc"]["tpot_ms_median"], 3),
        "paired_tpot_http_over_grpc": round(
            paired_faces["http"]["tpot_ms_median"] / paired_faces["grpc"]["tpot_ms_median"], 3
        ),
        # per pair, then the median: each pair shared its decode steps
        "paired_tpot_ratio_median": round(
            statistics.median(
                h["tpot_s"] / g["tpot_s"] for g, h in zip(paired["grpc"], paired["http"], strict=True)
            ),
            3,
        ),
    }
    for face in ("grpc", "http"):
        s, p = faces[face], paired_faces[face]
        print(
            f"{face:4s}: sequential TTFT median {s['ttft_ms_median']:8.1f} ms, TPOT median "
            f"{s['tpot_ms_median']:7.2f} ms; paired TPOT median {p['tpot_ms_median']:7.2f} ms"
        )
    print(
        f"HTTP/gRPC: sequential TTFT {ratios['ttft_http_over_grpc']:.3f}x, "
        f"TPOT {ratios['tpot_http_over_grpc']:.3f}x; paired TPOT {ratios['paired_tpot_ratio_median']:.3f}x "
        "(median of per-pair ratios; target <= 1.05x)"
    )
    return {
        "sequential": faces,
        "paired": paired_faces,
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
            "clients": "grpc.aio Generate stream vs httpx SSE /v1/completions, same process; sequential: one "
            "at a time (ABBA); paired: one of each at once",
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
    out = result_path("http", "cpu", args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
