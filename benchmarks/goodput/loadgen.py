"""The load generator: streams chat completions from any OpenAI-compatible server over HTTP
(httpx, async, server-sent events) and records per request what `stats.RequestResult` holds;
drives them open-loop (Poisson arrivals at a set rate, seeded, bounded in count and time) or one
at a time (the uncontended "quiet" runs). `run_all_at_once` sends a burst from several client
processes, so that the client's own CPU (httpx parses every event: ~100-200 us per token on one
core) does not set the pace of a server that streams faster than one client core can read.

TTFT is measured to the first chunk with non-empty content (a chat stream's first chunk holds
only the role); every later content chunk adds one inter-token latency. Token counts come from
the final `usage` chunk (`stream_options.include_usage`); without one the content chunks are
counted instead.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.goodput.stats import RequestResult
from benchmarks.goodput.workloads import Request


@dataclass(frozen=True)
class Target:
    base_url: str  # ends in /v1
    model: str
    api_key: str = ""
    ignore_eos: bool = True
    request_timeout_s: float = 600.0  # one request, send to last byte


def poisson_arrivals(rate_rps: float, count: int, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of `count` requests of a Poisson process at `rate_rps`:
    cumulative exponential gaps, the first one included."""
    if rate_rps <= 0:
        raise ValueError("rate must be > 0")
    t, times = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_rps)
        times.append(t)
    return times


def _body(target: Target, request: Request) -> dict[str, object]:
    body: dict[str, object] = {
        "model": target.model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


def _headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


async def send(
    client: httpx.AsyncClient, target: Target, request: Request, run_start: float
) -> RequestResult:
    """One streamed chat completion; never raises for a failed request (the status says why)."""
    sent = time.perf_counter()
    send_s = sent - run_start
    try:
        return await asyncio.wait_for(
            _stream(client, target, request, sent, send_s), target.request_timeout_s
        )
    except TimeoutError:
        return RequestResult(request.index, "timeout", send_s, error=f"over {target.request_timeout_s:g} s")
    except httpx.HTTPError as e:
        return RequestResult(request.index, "error", send_s, error=f"{type(e).__name__}: {e}")


async def _stream(
    client: httpx.AsyncClient, target: Target, request: Request, sent: float, send_s: float
) -> RequestResult:
    url = target.base_url.rstrip("/") + "/chat/completions"
    first: float | None = None
    last = sent
    itls: list[float] = []
    chunks = 0
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=_body(target, request), headers=_headers(target)) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            return RequestResult(request.index, f"http_{resp.status_code}", send_s, error=text)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return RequestResult(request.index, "error", send_s, error=str(event["error"])[:300])
            if event.get("usage"):
                usage = dict(event["usage"])
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itls.append(now - last)
                last = now
                chunks += 1
    end = time.perf_counter()
    if first is None:
        return RequestResult(
            request.index, "error", send_s, e2e_s=end - sent, error="no content in the stream"
        )
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        index=request.index,
        status="ok",
        send_s=send_s,
        ttft_s=first - sent,
        itl_s=tuple(itls),
        e2e_s=end - sent,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", chunks)),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


def _client() -> httpx.AsyncClient:
    # No pool limit: an open-loop client must never queue requests on its own side.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30.0), limits=httpx.Limits(max_connections=None)
    )


async def run_open_loop(
    target: Target, requests: Sequence[Request], rate_rps: float, seed: int, max_send_s: float
) -> list[RequestResult]:
    """Send `requests` at Poisson arrival times (seeded by `seed` and the rate) without waiting
    for answers; stops sending after `max_send_s` seconds; returns when every sent request ended
    (each bounded by the target's request timeout)."""
    arrivals = poisson_arrivals(rate_rps, len(requests), random.Random(f"{seed}:arrivals:{rate_rps:.6g}"))
    tasks: list[asyncio.Task[RequestResult]] = []
    async with _client() as client:
        start = time.perf_counter()
        for request, at in zip(requests, arrivals, strict=True):
            if at > max_send_s:
                break
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, target, request, start)))
        return list(await asyncio.gather(*tasks))


async def run_sequential(target: Target, requests: Sequence[Request]) -> list[RequestResult]:
    """One request at a time (uncontended latencies)."""
    results = []
    async with _client() as client:
        start = time.perf_counter()
        for request in requests:
            results.append(await send(client, target, request, start))
    return results


async def served_model(base_url: str, api_key: str = "", timeout_s: float = 10.0) -> str | None:
    """The first model id `GET /v1/models` lists, or None when the server lists none."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = await client.get(base_url.rstrip("/") + "/models", headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if data else None


def _burst_share(target: Target, requests: Sequence[Request], at: float) -> tuple[list[RequestResult], float]:
    """One client process's share of a burst, sent together at wall-clock time `at` (so that the
    processes start within a millisecond of each other); returns the results and this process's
    CPU seconds while sending and reading them."""
    time.sleep(max(0.0, at - time.time()))
    cpu = time.process_time()
    results = asyncio.run(run_open_loop(target, requests, 1e9, 0, 60.0))
    return results, time.process_time() - cpu


def run_all_at_once(
    target: Target, requests: Sequence[Request], processes: int
) -> tuple[list[RequestResult], float, float]:
    """Every request sent at once, from `processes` client processes (request i from process
    i % processes); returns the results in request order, the clients' CPU seconds and the wall
    seconds from the sending to the last answer (the processes' start-up not included)."""
    if processes <= 1:
        start = time.time()
        results, cpu_s = _burst_share(target, requests, 0.0)
        return results, cpu_s, time.time() - start
    shares = [list(requests[i::processes]) for i in range(processes)]
    # spawn: the parent holds torch's thread pools, which a fork would copy half-initialised;
    # the barrier holds the burst until every client process has started (imports take seconds)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(processes + 1)
    with ctx.Pool(processes, initializer=ready.wait) as pool:
        ready.wait()
        at = time.time() + 0.2
        done = pool.starmap(_burst_share, [(target, share, at) for share in shares], chunksize=1)
        wall_s = time.time() - at
    by_index = {r.index: r for results, _ in done for r in results}
    return [by_index[r.index] for r in requests], sum(cpu for _, cpu in done), wall_s
