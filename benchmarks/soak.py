"""Soak: N minutes of mixed load with cancels against the whole stack (processes, as `pdserve up`
starts them), printing every service's RSS series and a pass/fail line: RSS flat within
--tolerance (default 3 %) or --tolerance-mib (default 4 MiB) from minute --settle-min (default 2)
on. Not part of CI (`make soak`).

python -m benchmarks.soak --minutes 30 [--model default] [--concurrency 8] [--batch-lines 40]

With --batch-lines N, Batch API batches of N short requests run all the while beside the load
(one after the other, every third cancelled half way), and their counts are printed too. With
--responses, stored Responses API conversations run beside it too: three turns chained by
previous_response_id (one streamed), a background response streamed and, every third, cancelled
while it is read, another resumed from its log, each conversation deleted at its end; every
service's open file descriptors are sampled with its RSS and must not grow either.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import torch

from services import up, up_processes, up_shape
from shared.model_store import resolve_model
from shared.proto import gateway_pb2, gateway_pb2_grpc

WORDS = (
    "the",
    "cache",
    "keeps",
    "blocks",
    "of",
    "keys",
    "and",
    "values",
    "for",
    "every",
    "token",
    "a",
    "model",
    "has",
    "seen",
)


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


async def client(
    stub: gateway_pb2_grpc.GatewayStub, rng: random.Random, stop_at: float, counts: dict[str, int]
) -> None:
    words = WORDS
    while time.monotonic() < stop_at:
        n_words = rng.choice([4, 16, 64, 200])
        prompt = " ".join(rng.choice(words) for _ in range(n_words))
        req = gateway_pb2.GenerateRequest(
            prompt=prompt,
            max_tokens=rng.choice([8, 32, 96]),
            ignore_eos=True,
            temperature=rng.choice([0.0, 0.8]),
        )
        cancel_after = rng.randint(1, 6) if rng.random() < 0.2 else None
        call = stub.Generate(req, timeout=120)
        frames = 0
        try:
            async for _ in call:
                frames += 1
                if cancel_after is not None and frames >= cancel_after:
                    call.cancel()
                    counts["cancelled"] += 1
                    break
            else:
                counts["ok"] += 1
        except grpc.aio.AioRpcError as exc:
            counts[exc.code().name] = counts.get(exc.code().name, 0) + 1


async def load(
    gateway: str, minutes: float, concurrency: int, sample: Callable[[], None], every_s: float
) -> dict[str, int]:
    counts = {"ok": 0, "cancelled": 0}
    stop_at = time.monotonic() + minutes * 60
    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        tasks = [
            asyncio.ensure_future(client(stub, random.Random(i), stop_at, counts)) for i in range(concurrency)
        ]
        while time.monotonic() < stop_at:
            sample()
            await asyncio.sleep(every_s)
        await asyncio.gather(*tasks)
        sample()
    return counts


def batch_load(url: str, lines: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Batches of `lines` short completions, one after the other until `stop`; every third is
    cancelled once half its requests are done. `counts`: batches by final status, and requests."""
    import json

    import httpx

    rows = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": " ".join(random.choices(WORDS, k=12)), "max_tokens": 8}}
        for i in range(lines)
    ]  # fmt: skip
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    with httpx.Client(base_url=url, timeout=60) as client:
        n = 0
        while not stop.is_set():
            n += 1
            sent = client.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
            file_id = sent.json()["id"]
            body = {
                "input_file_id": file_id,
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            }
            batch = client.post("/v1/batches", json=body).json()
            cancelled = False
            while not stop.is_set():
                batch = client.get(f"/v1/batches/{batch['id']}").json()
                if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
                done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
                if n % 3 == 0 and not cancelled and done >= lines // 2:
                    client.post(f"/v1/batches/{batch['id']}/cancel")
                    cancelled = True
                time.sleep(0.5)
            counts[batch["status"]] = counts.get(batch["status"], 0) + 1
            counts["requests"] = counts.get("requests", 0) + batch["request_counts"]["completed"]
            client.delete(f"/v1/files/{file_id}")


def response_load(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """Stored-response conversations until `stop` (see the module's docstring); `counts`: by
    what happened."""
    import httpx

    def create(client: httpx.Client, **body: object) -> dict[str, object]:
        answer = client.post("/v1/responses", json={"input": "tell me more", "max_output_tokens": 12, **body})
        answer.raise_for_status()
        return dict(answer.json())

    def events(client: httpx.Client, method: str, path: str, cancel_after: int = 0, **kw: object) -> str:
        """Reads a stream of events (cancelling its response after `cancel_after` deltas); the
        response's id."""
        import json

        seen, response_id = 0, ""
        with client.stream(method, path, **kw) as answer:  # type: ignore[arg-type]
            for line in answer.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: ") :])
                response_id = event.get("response", {}).get("id", response_id)
                seen += event["type"] == "response.output_text.delta"
                if cancel_after and seen == cancel_after:
                    client.post(f"/v1/responses/{response_id}/cancel")
        return response_id

    with httpx.Client(base_url=url, timeout=120) as client:
        n = 0
        while not stop.is_set():
            n += 1
            kept: list[str] = []
            previous = None
            for turn in range(3):
                body: dict[str, object] = {"previous_response_id": previous} if previous else {}
                if turn == 1:  # streamed: the next turn continues the first
                    streamed = {"input": "go on", "stream": True, **body}
                    kept.append(events(client, "POST", "/v1/responses", json=streamed))
                    continue
                previous = str(create(client, **body)["id"])
                kept.append(previous)
            counts["turns"] = counts.get("turns", 0) + 3
            long = {"input": "count", "background": True, "max_output_tokens": 64, "ignore_eos": True}
            cancel_after = 4 if n % 3 == 0 else 0
            kept.append(events(client, "POST", "/v1/responses", cancel_after, json={**long, "stream": True}))
            counts["background_streams"] = counts.get("background_streams", 0) + 1
            queued = create(client, **long)
            while client.get(f"/v1/responses/{queued['id']}").json()["status"] in ("queued", "in_progress"):
                time.sleep(0.2)
            events(
                client,
                "GET",
                f"/v1/responses/{queued['id']}",
                params={"stream": "true", "starting_after": "3"},
            )
            counts["resumed"] = counts.get("resumed", 0) + 1
            for response_id in [*kept, str(queued["id"])]:
                client.delete(f"/v1/responses/{response_id}")


def rss_growth(settled: Sequence[float]) -> float:
    """MiB an RSS series (or count: a series of open file descriptors) grew after settling: the
    median of its last third minus the median of its first third. A leak raises the whole tail;
    a worker whose RSS swings with the sizes of the chunks it happens to be running (a prefill
    worker: +-35 MiB sample to sample) does not, where the largest sample minus the first would
    call one high sample growth."""
    third = max(1, len(settled) // 3)
    return statistics.median(settled[-third:]) - statistics.median(settled[:third])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-s", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--settle-min", type=float, default=2.0, help="minute from which RSS must be flat")
    p.add_argument("--tolerance", type=float, default=0.03, help="allowed growth after settling (fraction)")
    p.add_argument(
        "--tolerance-mib",
        type=float,
        default=4.0,
        help="growth always allowed (MiB): 3 %% of a 55 MiB control-plane service is under 2 MiB, "
        "less than its bounded caches fill in a soak (the scheduler's prefix index: <= 12 MiB per worker)",
    )
    p.add_argument("--port-base", type=int, default=0)
    p.add_argument(
        "--batch-lines", type=int, default=0, help="run Batch API batches of N requests beside the load"
    )
    p.add_argument(
        "--responses", action="store_true", help="run stored Responses API conversations beside the load"
    )
    p.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="extra `pdserve up` argument, repeatable (e.g. --up-arg=--worker-arg=--speculative=ngram "
        "soaks speculation: every request's n-gram index must go with it)",
    )
    a = p.parse_args()

    from tests.support.stack import free_port_base  # the same free-port search the e2e tests use

    model = str(resolve_model(a.model, None))
    base = a.port_base or free_port_base()
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    up_args = ["--model", model, "--port-base", str(base), "--log-dir", str(log_dir), "--torch-threads", "1"]
    up_args += ["--batch-dir", str(log_dir / "batches"), "--response-dir", str(log_dir / "responses")]
    args = up._parse([*up_args, *a.up_arg])
    children = up_shape.children(args, model)
    print(
        f"soak: {a.minutes} min, concurrency {a.concurrency}, model {Path(model).name}, "
        f"up args {a.up_arg or 'none'}; "
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}; "
        f"logs {log_dir}",
        flush=True,
    )
    for child in children:
        up_processes.start(child, str(log_dir))
    try:
        problem = up_processes.wait_ready(children, 2, 600, threading.Event(), None)
        if problem:
            raise SystemExit(f"soak: the stack did not come up: {problem}")
        t0 = time.monotonic()
        series: dict[str, list[tuple[float, float]]] = {c.name: [] for c in children}
        fds: dict[str, list[tuple[float, int]]] = {c.name: [] for c in children}

        def sample() -> None:
            t_min = (time.monotonic() - t0) / 60
            for c in children:
                assert c.proc is not None
                rss, files = rss_mib(c.proc.pid), open_fds(c.proc.pid)
                if rss is not None:
                    series[c.name].append((t_min, rss))
                if files is not None:
                    fds[c.name].append((t_min, files))

        stop = threading.Event()
        batches: dict[str, int] = {}
        batcher = threading.Thread(
            target=batch_load,
            args=(f"http://127.0.0.1:{base + 40}", a.batch_lines, stop, batches),
            daemon=True,
        )
        responses: dict[str, int] = {}
        responder = threading.Thread(
            target=response_load, args=(f"http://127.0.0.1:{base + 40}", stop, responses), daemon=True
        )
        if a.batch_lines:
            batcher.start()
        if a.responses:
            responder.start()
        counts = asyncio.run(load(f"127.0.0.1:{base}", a.minutes, a.concurrency, sample, a.sample_s))
        stop.set()
        if a.batch_lines:
            batcher.join(timeout=120)
        if a.responses:
            responder.join(timeout=120)
            left = sorted(p.name for p in (log_dir / "responses").glob("resp_*"))
            responses["files_left"] = len(left)
    finally:
        up_processes.stop_all(children, grace_s=30)
    print(f"requests: {counts}")
    if a.batch_lines:
        print(f"batches: {batches}")
    if a.responses:
        print(f"responses: {responses}")
    ok_all = True
    for name, points in series.items():
        settled = [rss for t, rss in points if t >= a.settle_min]
        line = " ".join(f"{t:.1f}m:{rss:.0f}" for t, rss in points)
        if len(settled) >= 3:
            growth_mib = rss_growth(settled)
            growth = growth_mib / statistics.median(settled)
            ok = growth <= a.tolerance or growth_mib <= a.tolerance_mib
            ok_all &= ok
            verdict = (
                f"growth from minute {a.settle_min:g}: {growth * 100:+.1f}% ({growth_mib:+.1f} MiB; "
                f"samples within {max(settled) - min(settled):.0f} MiB) {'ok' if ok else 'FAIL'}"
            )
        else:
            verdict = "too short to judge"
            ok_all = False
        print(f"{name:16s} RSS MiB  {line}\n{'':16s} {verdict}")
        held = [n for t, n in fds[name] if t >= a.settle_min]
        if len(held) >= 3:
            more = int(rss_growth(held))  # the same tail-against-head median
            fds_ok = more <= 16  # sockets of connections in flight come and go; a leak keeps climbing
            ok_all &= fds_ok
            print(
                f"{'':16s} open fds {' '.join(str(n) for n in held)}: {more:+d} {'ok' if fds_ok else 'FAIL'}"
            )
    print(
        f"soak: {'PASS' if ok_all else 'FAIL'} (RSS flat within {a.tolerance * 100:g}% or "
        f"{a.tolerance_mib:g} MiB from minute {a.settle_min:g}; "
        "shared, loaded machine: timings are noisy, RSS is not)"
    )
    raise SystemExit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
