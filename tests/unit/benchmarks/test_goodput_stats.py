"""The goodput benchmark's pure functions: percentiles, TPOT, SLO checks, summaries, SLO
derivation and the goodput search."""

from __future__ import annotations

import math

import pytest

from benchmarks.goodput.stats import (
    RequestResult,
    SearchPlan,
    Slo,
    SloRule,
    attainment,
    derive_slo,
    goodput,
    meets_slo,
    next_rate,
    percentile,
    single_stream_rps,
    summarize,
)


def ok(ttft: float, e2e: float, tokens: int, send: float = 0.0, itl: tuple[float, ...] = ()) -> RequestResult:
    return RequestResult(
        0, "ok", send, ttft_s=ttft, itl_s=itl, e2e_s=e2e, prompt_tokens=100, completion_tokens=tokens
    )


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_tpot_excludes_the_first_token_and_needs_two() -> None:
    assert ok(0.5, 2.5, 5).tpot_s == pytest.approx(0.5)
    assert ok(0.5, 0.5, 1).tpot_s is None
    assert RequestResult(0, "http_429", 0.0).tpot_s is None


def test_meets_slo_needs_success_and_both_bounds() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert meets_slo(ok(1.0, 1.9, 10), slo)  # TPOT exactly 0.1 meets it
    assert not meets_slo(ok(1.01, 1.5, 10), slo)  # TTFT over
    assert not meets_slo(ok(0.5, 2.0, 10), slo)  # TPOT 0.167 over
    assert meets_slo(ok(0.5, 0.5, 1), slo)  # one token: no TPOT to miss
    assert not meets_slo(RequestResult(0, "timeout", 0.0), slo)
    assert attainment(
        [ok(0.5, 1.0, 10), ok(2.0, 3.0, 10), RequestResult(1, "error", 0.0)], slo
    ) == pytest.approx(1 / 3)
    assert attainment([], slo) == 0.0


def test_summarize_reports_rates_percentiles_and_failures() -> None:
    results = [
        ok(0.2, 1.0, 5, send=0.0, itl=(0.2, 0.2, 0.2, 0.2)),
        ok(0.4, 2.0, 9, send=1.0, itl=(0.2,) * 8),
        RequestResult(2, "http_429", 1.5),
    ]
    s = summarize(results, Slo(ttft_s=0.3, tpot_s=1.0))
    assert s["requests"] == 3 and s["ok"] == 2
    assert s["errors"] == {"http_429": 1}
    assert s["span_s"] == 3.0  # first send 0.0 -> last end 1.0 + 2.0
    assert s["throughput_rps"] == pytest.approx(2 / 3, abs=1e-3)
    assert s["output_tokens_per_s"] == pytest.approx(14 / 3, abs=0.01)
    assert s["ttft_p50_ms"] == pytest.approx(300.0)
    assert s["itl_p99_ms"] == pytest.approx(200.0)
    assert s["completion_tokens_mean"] == 7.0
    assert s["attainment"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["ttft_attainment"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["tpot_attainment"] == pytest.approx(2 / 3, abs=1e-3)
    assert "attainment" not in summarize(results, None)


def test_summarize_of_nothing_successful_has_no_percentiles() -> None:
    s = summarize([RequestResult(0, "error", 0.0)], Slo(1, 1))
    assert s["ttft_p90_ms"] is None and s["throughput_rps"] == 0.0 and s["attainment"] == 0.0


def test_slos_come_from_the_fastest_configuration_p90() -> None:
    quiet = {
        "slow": [ok(1.0, 11.0, 11), ok(1.2, 12.2, 11)],  # TTFT p90 1.18, TPOT 1.0 / 1.1
        "fast": [ok(0.5, 2.5, 11), ok(0.6, 2.6, 11)],  # TTFT p90 0.59, TPOT 0.2
    }
    slo, lines = derive_slo(quiet, SloRule(ttft_factor=4, tpot_factor=3))
    assert slo.ttft_s == pytest.approx(4 * 0.59)
    assert slo.tpot_s == pytest.approx(3 * 0.2)
    assert any("SLO TTFT" in line and "fast" in line for line in lines)
    assert single_stream_rps(quiet) == pytest.approx(1 / 2.55)
    with pytest.raises(ValueError):
        derive_slo({"x": [RequestResult(0, "error", 0.0)]}, SloRule())


def test_goodput_ignores_a_lucky_pass_above_a_failure() -> None:
    assert goodput([(1.0, 1.0), (2.0, 0.95), (4.0, 0.5), (8.0, 0.92)]) == 2.0
    assert goodput([(1.0, 0.5)]) == 0.0
    assert goodput([]) == 0.0
    assert goodput([(1.0, 0.9)]) == 1.0  # the target itself passes


def _search(plan: SearchPlan, capacity: float) -> list[float]:
    points: list[tuple[float, float]] = []
    while (rate := next_rate(points, plan)) is not None:
        points.append((rate, 1.0 if rate <= capacity else 0.3))
    return [r for r, _ in points]


def test_search_sweeps_up_then_bisects_to_the_resolution() -> None:
    plan = SearchPlan(start_rps=1.0, growth=2.0, resolution=0.1, max_points=20)
    rates = _search(plan, capacity=3.3)
    assert rates[:3] == [1.0, 2.0, 4.0]
    found = goodput([(r, 1.0 if r <= 3.3 else 0.3) for r in rates])
    assert 3.3 / 1.1 <= found <= 3.3
    assert len(rates) <= 3 + math.ceil(math.log2(math.log(2) / math.log(1.1)))


def test_search_steps_down_when_the_first_rate_fails_and_stops_at_bounds() -> None:
    rates = _search(SearchPlan(start_rps=1.0, resolution=0.5, min_rps=0.1), capacity=0.3)
    assert rates[:3] == [1.0, 0.5, 0.25]
    assert _search(SearchPlan(start_rps=1.0, min_rps=0.3), capacity=0.01) == [1.0, 0.5]
    assert _search(SearchPlan(start_rps=1.0, max_rps=3.0), capacity=100) == [1.0, 2.0, 3.0]
    assert len(_search(SearchPlan(start_rps=1.0, max_points=3), capacity=100)) == 3


def test_search_plan_rejects_nonsense() -> None:
    for bad in ({"start_rps": 0}, {"start_rps": 1, "growth": 1.0}, {"start_rps": 1, "target": 0}):
        with pytest.raises(ValueError):
            SearchPlan(**bad)
