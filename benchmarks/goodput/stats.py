"""Pure functions of the goodput benchmark: per-request results, percentiles, per-rate metrics,
SLOs derived from uncontended runs, SLO attainment, and the goodput search (which rate to try
next, and the goodput of the rates tried). No I/O, no clock: everything here is unit-tested.

Definitions (as in DistServe and `vllm bench serve`):
- TTFT: send -> first content chunk. ITL: time between two successive content chunks (a chunk
  may carry more than one token). TPOT: (E2E - TTFT) / (completion_tokens - 1), per request.
- A request meets the SLO when it succeeded, its TTFT <= the TTFT SLO and its TPOT <= the TPOT
  SLO (a request with a single output token has no TPOT and meets that half).
- Attainment: share of the requests issued at a rate that meet the SLO (failed ones do not).
- Goodput: the highest rate with attainment >= the target (0.9) that lies below every rate
  that missed it (a lucky pass above a failure does not count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestResult:
    """What the load generator saw of one request; times in seconds."""

    index: int
    status: str  # "ok", "http_<code>", "error", "timeout"
    send_s: float  # when it was sent, since the start of its run
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    prompt_tokens: int = 0  # from `usage`; 0 when the server sent none
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets_slo(r: RequestResult, slo: Slo) -> bool:
    if not r.ok or r.ttft_s is None or r.ttft_s > slo.ttft_s:
        return False
    tpot = r.tpot_s
    return tpot is None or tpot <= slo.tpot_s


def attainment(results: Sequence[RequestResult], slo: Slo) -> float:
    """Share of `results` meeting both SLOs (0.0 for no results)."""
    if not results:
        return 0.0
    return sum(meets_slo(r, slo) for r in results) / len(results)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def summarize(results: Sequence[RequestResult], slo: Slo | None) -> dict[str, object]:
    """Metrics of one run (one config, workload and rate). Latencies in ms, rates per second over
    the run's span (first send to last completion); attainments when an SLO is given."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itl_s]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    ends = [r.send_s + r.e2e_s for r in ok if r.e2e_s is not None]
    span_s = (max(ends) - min(r.send_s for r in results)) if ends else 0.0
    completion = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    out: dict[str, object] = {
        "requests": len(results),
        "ok": len(ok),
        "errors": {
            s: sum(r.status == s for r in results) for s in sorted({r.status for r in results} - {"ok"})
        },
        "span_s": round(span_s, 3),
        "throughput_rps": round(len(ok) / span_s, 4) if span_s > 0 else 0.0,
        "output_tokens_per_s": round(completion / span_s, 2) if span_s > 0 else 0.0,
        "prompt_tokens_mean": round(prompt / len(ok), 1) if ok else 0.0,
        "completion_tokens_mean": round(completion / len(ok), 1) if ok else 0.0,
        "cached_share": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
    }
    for name, values, qs in (
        ("ttft", ttfts, (50, 90, 99)),
        ("itl", itls, (50, 90, 99)),
        ("tpot", tpots, (50, 90)),
        ("e2e", e2es, (50, 90)),
    ):
        for q in qs:
            out[f"{name}_p{q}_ms"] = _ms(percentile(values, q))
    if slo is not None:
        out["attainment"] = round(attainment(results, slo), 4)
        n = len(results) or 1
        out["ttft_attainment"] = round(
            sum(r.ok and r.ttft_s is not None and r.ttft_s <= slo.ttft_s for r in results) / n, 4
        )
        out["tpot_attainment"] = round(
            sum(r.ok and (r.tpot_s is None or r.tpot_s <= slo.tpot_s) for r in results) / n, 4
        )
    return out


@dataclass(frozen=True)
class SloRule:
    """SLO = factor x the p90 of uncontended (one request at a time) latencies, taking the
    fastest configuration's p90, so that no configuration is judged by its own slowness."""

    ttft_factor: float = 4.0
    tpot_factor: float = 3.0


def derive_slo(quiet: Mapping[str, Sequence[RequestResult]], rule: SloRule) -> tuple[Slo, list[str]]:
    """The SLO from the quiet runs of each configuration, and the lines that explain it."""
    lines = []
    best_ttft: tuple[float, str] | None = None
    best_tpot: tuple[float, str] | None = None
    for config, results in quiet.items():
        ok = [r for r in results if r.ok]
        ttft = percentile([r.ttft_s for r in ok if r.ttft_s is not None], 90)
        tpot = percentile([t for r in ok if (t := r.tpot_s) is not None], 90)
        lines.append(
            f"  quiet {config}: {len(ok)}/{len(results)} ok, "
            f"TTFT p90 {_fmt_ms(ttft)}, TPOT p90 {_fmt_ms(tpot)}"
        )
        if ttft is not None and (best_ttft is None or ttft < best_ttft[0]):
            best_ttft = (ttft, config)
        if tpot is not None and (best_tpot is None or tpot < best_tpot[0]):
            best_tpot = (tpot, config)
    if best_ttft is None or best_tpot is None:
        raise ValueError("no successful quiet request with a TTFT and a TPOT: cannot derive SLOs")
    slo = Slo(ttft_s=rule.ttft_factor * best_ttft[0], tpot_s=rule.tpot_factor * best_tpot[0])
    for name, factor, (base, config), value in (
        ("TTFT", rule.ttft_factor, best_ttft, slo.ttft_s),
        ("TPOT", rule.tpot_factor, best_tpot, slo.tpot_s),
    ):
        lines.append(f"  SLO {name} = {factor:g} x {_fmt_ms(base)} (p90, {config}) = {_fmt_ms(value)}")
    return slo, lines


def _fmt_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:.1f} ms"


def single_stream_rps(quiet: Mapping[str, Sequence[RequestResult]]) -> float:
    """Requests per second of one request at a time on the fastest configuration (1 / mean E2E):
    the natural unit for the sweep's first rate."""
    means = []
    for results in quiet.values():
        e2es = [r.e2e_s for r in results if r.ok and r.e2e_s]
        if e2es:
            means.append(sum(e2es) / len(e2es))
    if not means:
        raise ValueError("no successful quiet request: cannot size the rate sweep")
    return 1.0 / min(means)


# --- the goodput search: a sweep upward by `growth`, then bisection of the bracket ---


@dataclass(frozen=True)
class SearchPlan:
    start_rps: float
    growth: float = 2.0  # each sweep step multiplies the rate by this
    resolution: float = 0.1  # stop refining when the bracket's ratio is within 1 + this
    max_rps: float = math.inf
    min_rps: float = 0.0
    target: float = 0.9
    max_points: int = 10

    def __post_init__(self) -> None:
        if self.start_rps <= 0 or self.growth <= 1 or self.resolution <= 0:
            raise ValueError("start_rps > 0, growth > 1 and resolution > 0 are required")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """Highest rate with attainment >= target below every failing rate; 0.0 when none passes.
    `points` are (rate, attainment) pairs."""
    failing = [r for r, a in points if a < target]
    ceiling = min(failing, default=math.inf)
    passing = [r for r, a in points if a >= target and r < ceiling]
    return max(passing, default=0.0)


def next_rate(points: Sequence[tuple[float, float]], plan: SearchPlan) -> float | None:
    """The next rate to measure given the (rate, attainment) points so far, or None when the
    search is done: sweep up from `start_rps` by `growth` until a rate fails (or `max_rps`),
    down by `growth` if the first rate already fails (until `min_rps`), then bisect (geometric
    mean) between the best passing and the lowest failing rate until their ratio is within
    1 + `resolution`. At most `max_points` points."""
    if not points:
        return plan.start_rps
    if len(points) >= plan.max_points:
        return None
    rates = [r for r, _ in points]
    failing = [r for r, a in points if a < plan.target]
    if not failing:
        top = max(rates)
        if top >= plan.max_rps:
            return None
        return min(top * plan.growth, plan.max_rps)
    lowest_fail = min(failing)
    best = goodput(points, plan.target)
    if best == 0.0:
        lowest = min(rates)
        step = lowest / plan.growth
        return step if step >= plan.min_rps and step > 0 else None
    if lowest_fail / best <= 1 + plan.resolution:
        return None
    return math.sqrt(best * lowest_fail)
