"""benchmarks/engine_steps.py: a worker's step counters parsed from its /metrics text (summed over
DP ranks), and what a phase ran per step kind from two snapshots."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks.engine_steps import delta, parse


def _metrics(rows: list[tuple[str, str, int, float, int]]) -> str:
    """(dp_rank, kind, steps, seconds, tokens) -> a worker's exposition text."""
    reg = CollectorRegistry()
    steps = Counter("pdserve_engine_steps_total", "", ["dp_rank", "kind"], registry=reg)
    seconds = Counter("pdserve_engine_step_seconds_total", "", ["dp_rank", "kind"], registry=reg)
    tokens = Counter("pdserve_engine_step_tokens_total", "", ["dp_rank", "kind"], registry=reg)
    other = Counter("pdserve_preemptions_total", "", ["dp_rank"], registry=reg)
    other.labels(dp_rank="0").inc(3)
    for rank, kind, n, s, t in rows:
        steps.labels(dp_rank=rank, kind=kind).inc(n)
        seconds.labels(dp_rank=rank, kind=kind).inc(s)
        tokens.labels(dp_rank=rank, kind=kind).inc(t)
    return generate_latest(reg).decode()


def test_counters_are_summed_over_ranks_and_differenced_per_phase() -> None:
    before = {"worker": parse(_metrics([("0", "decode", 10, 0.05, 80), ("1", "decode", 10, 0.05, 80)]))}
    assert before["worker"] == {"decode": [20.0, 0.1, 160.0]}
    after = {
        "worker": parse(
            _metrics(
                [("0", "decode", 110, 0.55, 880), ("1", "decode", 10, 0.05, 80), ("0", "mixed", 4, 0.2, 2080)]
            )
        )
    }
    assert delta(before, after) == {
        "worker": {
            "decode": {"steps": 100, "ms_mean": 5.0, "tokens_per_step": 8.0, "seconds": 0.5},
            "mixed": {"steps": 4, "ms_mean": 50.0, "tokens_per_step": 520.0, "seconds": 0.2},
        }
    }
    assert delta(after, after) == {"worker": {}}


def test_a_phase_reports_the_stalls_it_had() -> None:
    """The GPU allocator's retries (per device, summed) and torch.compile's frames."""

    def worker(retries: dict[str, int], compiles: int) -> str:
        reg = CollectorRegistry()
        counter = Counter("pdserve_gpu_alloc_retries_total", "", ["device"], registry=reg)
        for device, n in retries.items():
            counter.labels(device=device).inc(n)
        Counter("pdserve_torch_compiles_total", "", registry=reg).inc(compiles)
        return _metrics([("0", "decode", 10, 0.05, 80)]) + generate_latest(reg).decode()

    before = {"worker": parse(worker({"cuda:0": 1, "cuda:1": 0}, 7))}
    after = {"worker": parse(worker({"cuda:0": 3, "cuda:1": 2}, 7))}
    assert delta(before, after) == {"worker": {"gpu_alloc_retries": {"count": 4}}}
    assert delta(after, after) == {"worker": {}}
    later = {"worker": parse(worker({"cuda:0": 3, "cuda:1": 2}, 9))}
    assert delta(after, later) == {"worker": {"torch_compiles": {"count": 2}}}


def test_bench_engine_reports_the_rounds_steps_over_every_rank() -> None:
    """bench-engine's pdserve contender: the measured round's steps by kind (the warm-up's
    subtracted), ranks together."""
    from benchmarks.engine.pdserve import steps_by_kind
    from services.worker.engine.step_stats import StepKind, StepStats

    warm, r0, r1 = StepStats(), StepStats(), StepStats()
    warm.record(StepKind.PREFILL, 9_000_000, 16)
    for stats in (r0, r1):
        stats.record(StepKind.PREFILL, 9_000_000, 16)  # the warm-up, on each rank
        stats.record(StepKind.DECODE, 5_000_000, 8)
        stats.record(StepKind.MIXED, 40_000_000, 520)
    r1.record(StepKind.DECODE, 7_000_000, 8)
    assert steps_by_kind([warm, warm], [r0, r1]) == {
        "decode": {"steps": 3, "ms_mean": 5.667, "tokens_per_step": 8.0, "seconds": 0.017},
        "mixed": {"steps": 2, "ms_mean": 40.0, "tokens_per_step": 520.0, "seconds": 0.08},
    }
