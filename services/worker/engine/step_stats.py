"""Per-rank counters of the engine's steps by kind (cumulative since start), read by the worker's
metrics (`pdserve_engine_steps_total`, `..._step_seconds_total`, `..._step_tokens_total`).

Why: what a request waits through is set by the steps its rank runs, and a decode step, a
prompt's chunk and a mixed step (chunks and decode rows together, chunked prefill) cost very
different times. On a GPU a burst's prefill phase took ~3x what its steps cost in isolation
(benchmarks/results/serving-llama-8b-h200.json against cuda-step-profile-h200.json, 2026-11-28):
the steps' own count, time and tokens per kind, as served, tell where it goes.

A step's kind, from what it computes: `decode` every sequence one new token (a prompt chunk of
one token counts as a decode row: the step costs the same); `verify` some
sequence samples more than one position (speculative decoding's verify pass, a draft model's
catch-up); `prefill` prompt chunks only; `mixed` prompt chunks and decode rows. Its time is its
wall time on the step thread, from launch to its outputs on the host; with async scheduling a
decode step overlaps the one before, so only what ran past the previous step's end counts (the
sum of a kind's seconds is then the rank's time in that kind of step).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class StepKind(enum.Enum):
    DECODE = "decode"
    VERIFY = "verify"
    PREFILL = "prefill"
    MIXED = "mixed"


class _Seq(Protocol):
    """What a step's kind is read from (model_runner.ScheduledSeq)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_logits(self) -> int: ...


def step_kind(batch: Sequence[_Seq]) -> StepKind:
    """The kind of a step of these sequences (the module docstring defines them)."""
    if any(s.num_logits > 1 for s in batch):
        return StepKind.VERIFY
    single = sum(1 for s in batch if len(s.token_ids) == 1)
    if single == len(batch):
        return StepKind.DECODE
    return StepKind.MIXED if single else StepKind.PREFILL


@dataclass
class KindStats:
    steps: int = 0  # steps run (count)
    ns: int = 0  # their wall time (nanoseconds)
    tokens: int = 0  # tokens whose K/V they computed (count; decode rows 1 each)


@dataclass
class StepStats:
    by_kind: dict[StepKind, KindStats] = field(default_factory=dict)

    def record(self, kind: StepKind, ns: int, tokens: int) -> None:
        stats = self.by_kind.setdefault(kind, KindStats())
        stats.steps += 1
        stats.ns += max(0, ns)
        stats.tokens += tokens

    def copy(self) -> StepStats:
        return StepStats({k: KindStats(v.steps, v.ns, v.tokens) for k, v in self.by_kind.items()})
