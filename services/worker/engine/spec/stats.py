"""Per-rank speculative-decoding counters (cumulative since start), read by the worker's metrics
and GetLoad."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verifications of a run with at least one proposal (count)
    num_draft_tokens: int = 0  # proposals verified (count)
    num_accepted_tokens: int = 0  # proposals accepted (count)
    # accepted proposals by position in their run (index 0 = first proposal; count)
    accepted_per_position: list[int] = field(default_factory=list)
    # the rank's current step-cost model (ms; policy.StepCost.terms(): fixed, per_seq,
    # per_token, verify), None without one
    step_cost_ms: tuple[float, float, float, float] | None = None

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> SpecStats:
        return SpecStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
            self.step_cost_ms,
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed (0 when nothing was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
