"""The goodput load generator against a local OpenAI-compatible SSE server: what it sends, what
it records per request, open-loop sending, its bounds, and failures reported as statuses."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.goodput.loadgen import (
    Target,
    poisson_arrivals,
    run_all_at_once,
    run_open_loop,
    run_sequential,
    served_model,
)
from benchmarks.goodput.workloads import Request
from tests.support.fake_openai import FakeServer, running_fake_server


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with running_fake_server(ttft_s=0.05, itl_s=0.01) as server:
        yield server


def req(index: int, text: str = "hello", max_tokens: int = 5) -> Request:
    return Request(index, ({"role": "user", "content": text},), max_tokens, 1)


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate() -> None:
    a = poisson_arrivals(4.0, 4000, random.Random(1))
    assert a == poisson_arrivals(4.0, 4000, random.Random(1))
    assert all(x < y for x, y in itertools.pairwise(a))
    assert 4000 / a[-1] == pytest.approx(4.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_arrivals(0, 1, random.Random(0))


async def test_streams_and_records_ttft_itls_and_usage(fake: FakeServer) -> None:
    assert await served_model(fake.base_url) == "fake-model"
    target = Target(fake.base_url, "fake-model")
    [r] = await run_sequential(target, [req(0, max_tokens=5)])
    assert r.ok, r.error
    assert r.completion_tokens == 5 and r.prompt_tokens == 42 and r.cached_tokens == 16
    assert len(r.itl_s) == 4  # the role-only chunk is not a token
    assert r.ttft_s is not None and r.e2e_s is not None and r.ttft_s >= 0.05
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    body = fake.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["model"] == "fake-model"
    await run_sequential(Target(fake.base_url, "fake-model", ignore_eos=False), [req(1)])
    assert "ignore_eos" not in fake.bodies[-1]


async def test_failures_become_statuses(fake: FakeServer) -> None:
    target = Target(fake.base_url, "fake-model", request_timeout_s=0.5)
    results = await run_sequential(
        target, [req(0, "[[status 429]]"), req(1, "[[error midway]]"), req(2, "[[hang]]")]
    )
    assert [r.status for r in results] == ["http_429", "error", "timeout"]
    assert "busy" in results[0].error and "worker lost" in results[1].error
    deadline = time.monotonic() + 5
    while fake.disconnects < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert fake.disconnects >= 1  # a timed-out request closes its connection


async def test_open_loop_does_not_wait_for_answers() -> None:
    with running_fake_server(ttft_s=0.5, itl_s=0.01) as slow:
        target = Target(slow.base_url, "fake-model")
        results = await run_open_loop(
            target, [req(i) for i in range(6)], rate_rps=50.0, seed=0, max_send_s=60
        )
        assert [r.index for r in results] == list(range(6)) and all(r.ok for r in results)
        assert slow.max_in_flight >= 3  # sent while earlier ones were still streaming
        sends = [r.send_s for r in results]
        assert sends == sorted(sends)


async def test_open_loop_stops_sending_after_its_time_bound(fake: FakeServer) -> None:
    target = Target(fake.base_url, "fake-model")
    rate, max_send_s = 5.0, 1.0
    arrivals = poisson_arrivals(rate, 50, random.Random(f"7:arrivals:{rate:.6g}"))
    results = await run_open_loop(target, [req(i, max_tokens=2) for i in range(50)], rate, 7, max_send_s)
    assert len(results) == sum(t <= max_send_s for t in arrivals) < 50


def test_a_burst_from_two_client_processes_returns_every_result_in_order() -> None:
    with running_fake_server(ttft_s=0.5, itl_s=0.01) as slow:
        target = Target(slow.base_url, "fake-model")
        burst = [req(i, max_tokens=3) for i in range(6)]
        results, cpu_s, wall_s = run_all_at_once(target, burst, processes=2)
        assert [r.index for r in results] == list(range(6)) and all(r.ok for r in results)
        assert all(r.completion_tokens == 3 for r in results)
        assert slow.max_in_flight == 6  # both processes' requests streamed at once
        assert cpu_s > 0 and wall_s >= 0.5  # the fake's time to first token


def test_the_whole_harness_against_a_given_base_url(
    fake: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--base-url mode end to end: quiet runs -> SLOs -> sweep -> goodput, JSON and plots."""
    from benchmarks import bench_goodput
    from tests.unit.benchmarks.test_goodput_workloads import WordTokenizer

    monkeypatch.setattr(bench_goodput, "load_tokenizer", lambda name: WordTokenizer())
    out = tmp_path / "goodput.json"
    argv = ["--base-url", fake.base_url, "--quick", "--workloads", "chat,shared_prefix", "--out", str(out)]
    # SLOs far above anything a loaded machine does to the fake server: every rate passes
    sizes = ["--quiet-requests", "2", "--max-requests", "3", "--min-requests", "2"]
    doc = bench_goodput.main([*argv, *sizes, "--ttft-factor", "1000", "--tpot-factor", "1000"])
    saved = json.loads(out.read_text())
    assert saved["goodput_rps"] == doc["goodput_rps"]
    for w in ("chat", "shared_prefix"):
        points = saved["runs"][w]["external"]
        assert len(points) == 3  # --quick: three rates, all passing against a steady server
        assert [p["rate_rps"] for p in points] == sorted(p["rate_rps"] for p in points)
        assert saved["goodput_rps"][w]["external"] == points[-1]["rate_rps"]
        assert saved["goodput_lower_bound_only"][w]["external"] is True
        assert saved["slo"][w]["ttft_ms"] > 0 and saved["slo"][w]["derivation"]
        assert saved["itl_samples"][w]["by_config"]["external"]
    assert saved["machine"]["torch"] and saved["machine"]["cpu_count"]
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "goodput.png",
        "goodput-latency.png",
        "goodput-itl.png",
    }
