"""Per-worker circuit breakers (pure, clock injected): a worker that failed `failure_threshold`
times in a row is left out of scheduling (its id joins the request's exclude list) for
`cooldown_s`; then it is half-open: one request may go there as a probe; success closes the
breaker, failure opens it again. So a sick worker stops receiving traffic before its lease expires.

Also `backoff_s`: the jittered exponential pause before a retry or a migration."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _State:
    failures: int = 0  # consecutive
    opened_at_s: float | None = None  # None: closed
    probe_at_s: float | None = None  # when the half-open probe was let through


class CircuitBreakers:
    def __init__(
        self, failure_threshold: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._states: dict[str, _State] = {}

    def exclusions(self) -> tuple[str, ...]:
        """Worker ids to leave out of the next scheduling decision. A worker past its cooldown is
        let through once (the probe); while that probe is out (at most one cooldown) it stays
        excluded."""
        if self.failure_threshold <= 0:
            return ()
        now = self._clock()
        out = []
        for worker_id, s in self._states.items():
            if s.opened_at_s is None:
                continue
            if now - s.opened_at_s < self.cooldown_s:
                out.append(worker_id)
            elif s.probe_at_s is None or now - s.probe_at_s >= self.cooldown_s:
                s.probe_at_s = now  # half-open: this decision may pick it
            else:
                out.append(worker_id)
        return tuple(out)

    def is_open(self, worker_id: str) -> bool:
        s = self._states.get(worker_id)
        return s is not None and s.opened_at_s is not None

    def record_success(self, worker_id: str) -> None:
        self._states.pop(worker_id, None)

    def record_failure(self, worker_id: str) -> None:
        if not worker_id or self.failure_threshold <= 0:
            return
        s = self._states.setdefault(worker_id, _State())
        s.failures += 1
        if s.failures >= self.failure_threshold or s.opened_at_s is not None:
            s.opened_at_s = self._clock()  # (re)open: a failed probe starts a new cooldown
            s.probe_at_s = None

    def forget_closed(self) -> None:
        """Drop closed entries that only count failures below the threshold (bounded memory)."""
        for worker_id in [w for w, s in self._states.items() if s.opened_at_s is None and s.failures == 0]:
            del self._states[worker_id]


def backoff_s(
    attempt: int, base_s: float = 0.05, cap_s: float = 1.0, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff before retry number `attempt` (1, 2, ...): uniform in
    [0, min(cap_s, base_s * 2**(attempt - 1))] (s)."""
    r = rng or random
    return r.uniform(0.0, min(cap_s, base_s * 2 ** max(0, attempt - 1)))
