"""What a running batch costs interactive traffic, in one run: `pdserve up --unified` (the bundled
SmolLM2 on CPU, fp32, one torch thread; `--max-num-seqs` small so that the worker is saturated and
requests wait), a few closed-loop interactive clients streaming chat completions over HTTP, and
three conditions, alternated over the repeats so that drift hits all alike:

- `alone`: the interactive clients only (the baseline);
- `batch`: the same while a batch of many requests runs (the Batch API's default priority, 10:
  lower is served first, interactive requests have 0);
- `batch_same_priority`: the same batch with every request at priority 0, as a batch would run if
  it were sent as ordinary requests (what the priority is worth).

Per interactive request: TTFT (first streamed text) and TPOT ((last - first) / (tokens - 1)).
Per batch condition: the batch's requests answered per second while the interactive clients ran.
Prints medians and the ratios to `alone`.

    python -m benchmarks.bench_batch [--mode disaggregated] [--quick]     (make bench-batch)

Writes benchmarks/results/batch-<machine class>.json (batch-disagg-... for --mode disaggregated),
with the machine it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.result_names import describe_machine, result_path
from tests.support.stack import running_stack

CONDITIONS = ("alone", "batch", "batch_same_priority")


def _question(i: int) -> str:
    return f"Question {i}: in two sentences, why do leaves change color in autumn?"


async def interactive(client: httpx.AsyncClient, i: int, max_tokens: int) -> dict[str, float]:
    body = {
        "messages": [{"role": "user", "content": _question(i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = last = 0.0
    pieces = 0
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", ())):
                last = time.perf_counter()
                first = first or last
                pieces += 1
    return {"ttft_s": first - t0, "tpot_s": (last - first) / max(1, pieces - 1)}


async def users(client: httpx.AsyncClient, n: int, seconds: float, max_tokens: int) -> list[dict[str, float]]:
    """`n` clients, each sending one request after the other for `seconds`."""
    done: list[dict[str, float]] = []
    end = time.monotonic() + seconds

    async def one_user(u: int) -> None:
        k = 0
        while time.monotonic() < end:
            done.append(await interactive(client, u * 1000 + k, max_tokens))
            k += 1

    await asyncio.gather(*(one_user(u) for u in range(n)))
    return done


async def start_batch(client: httpx.AsyncClient, lines: int, max_tokens: int, priority: int | None) -> str:
    rows = []
    for i in range(lines):
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"Batch item {i}: summarize the water cycle."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if priority is not None:
            body["priority"] = priority
        rows.append({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    upload = (
        await client.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
    ).json()
    batch = await client.post(
        "/v1/batches",
        json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    batch.raise_for_status()
    return str(batch.json()["id"])


async def completed(client: httpx.AsyncClient, batch_id: str) -> int:
    return int((await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"])


async def condition(client: httpx.AsyncClient, name: str, args: argparse.Namespace) -> dict[str, Any]:
    batch_id = None
    if name != "alone":
        priority = 0 if name == "batch_same_priority" else None
        batch_id = await start_batch(client, args.batch_lines, args.batch_tokens, priority)
        await asyncio.sleep(args.warmup_s)  # the batch fills the worker first
    before = await completed(client, batch_id) if batch_id else 0
    t0 = time.monotonic()
    done = await users(client, args.users, args.seconds, args.max_tokens)
    elapsed = time.monotonic() - t0
    row: dict[str, Any] = {
        "condition": name,
        "requests": len(done),
        "ttft_p50_s": statistics.median(d["ttft_s"] for d in done),
        "ttft_p90_s": statistics.quantiles([d["ttft_s"] for d in done], n=10)[-1] if len(done) > 1 else None,
        "tpot_p50_s": statistics.median(d["tpot_s"] for d in done),
    }
    if batch_id:
        row["batch_requests_per_s"] = (await completed(client, batch_id) - before) / elapsed
        await client.post(f"/v1/batches/{batch_id}/cancel")
        while (await client.get(f"/v1/batches/{batch_id}")).json()["status"] != "cancelled":
            await asyncio.sleep(0.2)
    return row


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per condition the median over the repeats of each figure, and the batch conditions'
    TTFT and TPOT as ratios to `alone`."""
    summary: dict[str, dict[str, float]] = {}
    for name in CONDITIONS:
        rows = [r for r in runs if r["condition"] == name]
        summary[name] = {
            key: statistics.median(r[key] for r in rows)
            for key in ("ttft_p50_s", "tpot_p50_s", "batch_requests_per_s")
            if key in rows[0]
        }
    for name in CONDITIONS[1:]:
        for key in ("ttft_p50_s", "tpot_p50_s"):
            summary[name][key.replace("_s", "_vs_alone")] = summary[name][key] / summary["alone"][key]
    return summary


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as logs,
        running_stack(
            "default",
            Path(logs),
            unified=args.mode == "unified",
            worker_args=[f"--max-num-seqs={args.max_num_seqs}"],
            up_args=[
                f"--batch-dir={Path(logs) / 'batches'}",
                f"--gateway-arg=--batch-concurrency={args.batch_concurrency}",
            ],
        ) as stack,
    ):
        base = stack.http_base_url.removesuffix("/v1")
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            await users(client, 1, 2.0, args.max_tokens)  # warm up
            runs = []
            for rep in range(args.repeats):
                order = CONDITIONS if rep % 2 == 0 else tuple(reversed(CONDITIONS))
                for name in order:
                    row = await condition(client, name, args)
                    print(json.dumps(row), flush=True)
                    runs.append({"repeat": rep, **row})
    return {
        "benchmark": "batch",
        "command": "python -m benchmarks.bench_batch"
        + (" --mode disaggregated" if args.mode == "disaggregated" else "")
        + (" --quick" if args.quick else ""),
        "setup": {
            k: getattr(args, k)
            for k in (
                "users",
                "seconds",
                "max_tokens",
                "max_num_seqs",
                "batch_concurrency",
                "batch_lines",
                "batch_tokens",
                "repeats",
            )
        },
        "model": f"SmolLM2-135M-Instruct (bundled), fp32, pdserve up ({args.mode}), 1 torch thread",
        "machine": describe_machine("cpu"),
        "runs": runs,
        "summary": summarize(runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=2, help="interactive clients, each closed-loop")
    p.add_argument("--seconds", type=float, default=40.0, help="interactive load per condition (s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per interactive answer")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the worker's running requests")
    p.add_argument("--batch-concurrency", type=int, default=16, help="the gateway's batch requests in flight")
    p.add_argument("--batch-lines", type=int, default=2000, help="requests in the batch (more than it runs)")
    p.add_argument("--batch-tokens", type=int, default=64, help="tokens per batch answer")
    p.add_argument("--warmup-s", type=float, default=5.0, help="the batch runs alone first (s)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--mode",
        choices=("unified", "disaggregated"),
        default="unified",
        help="one unified worker, or a prefill and a decode worker (each at --max-num-seqs)",
    )
    p.add_argument("--quick", action="store_true", help="a harness check: short, one repeat")
    p.add_argument("--out", default="", help="result file (default benchmarks/results/batch-<class>.json)")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.repeats, args.warmup_s, args.batch_lines = 6.0, 1, 2.0, 200
    result = asyncio.run(main_async(args))
    name = "batch" if args.mode == "unified" else "batch-disagg"
    out = Path(args.out) if args.out else result_path(name, quick=args.quick)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
