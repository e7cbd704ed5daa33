"""The engine benchmark's workload (seeded prompts spread evenly over a length range) and the
figures of one run (tokens/s, TTFT and TPOT percentiles, peak RSS)."""

from __future__ import annotations

import random
import resource
from typing import Any


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab - 100) for _ in range(k)] for k in lengths]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarize(t0: float, token_times: list[list[float]], wall_s: float) -> dict[str, Any]:
    """token_times[i]: arrival time (perf_counter s) of each generated token of request i."""
    n_tokens = sum(len(t) for t in token_times)
    ttft = [(t[0] - t0) * 1e3 for t in token_times if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in token_times if len(t) > 1]
    return {
        "tokens": n_tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(n_tokens / wall_s, 2),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
    }


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
