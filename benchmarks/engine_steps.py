"""A served stack's engine steps by kind, from its workers' Prometheus counters
(`pdserve_engine_steps_total`, `..._step_seconds_total`, `..._step_tokens_total`; engine/
step_stats.py): a snapshot per worker before and after a phase, and per kind what the phase ran:
steps, their mean wall time, tokens per step. Why: a burst's prefill phase on a GPU took ~3x
what its steps cost in isolation; the steps as served say where the time goes. Beside the step
kinds, two counts of what stalls a step (services/worker/torch_metrics.py): `gpu_alloc_retries`,
the GPU allocations the phase retried after torch's allocator freed its cache, and
`torch_compiles`, the frames torch.compile compiled during the phase (seconds each)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.worker.engine.step_stats import StepStats

# worker kind -> {step kind -> (steps, seconds, tokens)}, summed over DP ranks
Snapshot = dict[str, dict[str, list[float]]]

# a worker exports its counters every --load-refresh-s (1 s by default): a snapshot waits that
# long first, so it holds every step that ended before it was asked for
SETTLE_S = 1.2

_FIELDS = {
    "pdserve_engine_steps": 0,
    "pdserve_engine_step_seconds": 1,
    "pdserve_engine_step_tokens": 2,
}
# counters reported beside the step kinds: metric family -> the pseudo-kind that holds its
# count (first field) in a snapshot
STALLS = {"pdserve_gpu_alloc_retries": "gpu_alloc_retries", "pdserve_torch_compiles": "torch_compiles"}


def parse(text: str) -> dict[str, list[float]]:
    """One worker's /metrics text -> {step kind: [steps, seconds, tokens]} over its ranks."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        stall = STALLS.get(family.name)
        if stall is not None:
            count = sum(s.value for s in family.samples if s.name.endswith("_total"))
            out.setdefault(stall, [0.0, 0.0, 0.0])[0] += count
            continue
        field = _FIELDS.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out.setdefault(sample.labels["kind"], [0.0, 0.0, 0.0])[field] += sample.value
    return out


def totals(ranks: Sequence[StepStats]) -> dict[str, list[float]]:
    """An in-process engine's ranks (Engine.step_stats) -> {step kind: [steps, seconds, tokens]},
    as `parse` reads them from a worker's /metrics."""
    out: dict[str, list[float]] = {}
    for stats in ranks:
        for kind, s in stats.by_kind.items():
            t = out.setdefault(kind.value, [0.0, 0.0, 0.0])
            t[0] += s.steps
            t[1] += s.ns / 1e9
            t[2] += s.tokens
    return out


def snapshot(urls: dict[str, str]) -> Snapshot:
    """{worker kind: its /metrics URL} -> the counters now (a worker that does not answer: {})."""
    time.sleep(SETTLE_S)
    snap: Snapshot = {}
    for worker, url in urls.items():
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                snap[worker] = parse(resp.read().decode())
        except OSError:
            snap[worker] = {}
    return snap


def delta(before: Snapshot, after: Snapshot) -> dict[str, dict[str, dict[str, Any]]]:
    """Per worker and step kind, what ran between the two snapshots: steps, ms_mean (wall time
    per step), tokens_per_step, seconds (all of that kind's steps together); and each stall
    counter (STALLS) that grew during the phase, with its count."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for worker, kinds in after.items():
        rows: dict[str, dict[str, Any]] = {}
        for kind, (steps, seconds, tokens) in sorted(kinds.items()):
            b = before.get(worker, {}).get(kind, [0.0, 0.0, 0.0])
            n, s, t = steps - b[0], seconds - b[1], tokens - b[2]
            if kind in STALLS.values():
                if n > 0:
                    rows[kind] = {"count": int(n)}
                continue
            if n > 0:
                rows[kind] = {
                    "steps": int(n),
                    "ms_mean": round(s / n * 1e3, 3),
                    "tokens_per_step": round(t / n, 1),
                    "seconds": round(s, 3),
                }
        out[worker] = rows
    return out
