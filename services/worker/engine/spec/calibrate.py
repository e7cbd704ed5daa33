"""Start-up calibration of the step-cost model (policy.StepCostModel): times a few dummy decode
steps of different sizes on the rank's own runner, before any request arrives.

The dummy steps write and read block 0 only (every position of every dummy sequence maps to it),
like ModelRunner.warm_up: it holds no request yet, and rows of a block are always written before
a request reads them. On a CPU the time is the thread's CPU time (what the tokens cost, without
what other processes took); on an accelerator, wall-clock after a synchronize.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from services.worker.engine.api import SamplingConfig
from services.worker.engine.model_runner import ScheduledSeq
from services.worker.engine.spec.policy import StepCost, StepCostModel

# context each dummy sequence attends to (tokens): a typical short chat
_CONTEXT_TOKENS = 128
# (sequences, proposals per sequence) of the dummy steps, each timed _REPEATS times (best kept)
_SHAPES = ((1, 0), (1, 4), (1, 8), (4, 0), (4, 4), (8, 0), (8, 2), (8, 4))
_REPEATS = 3


def step_clock(device: torch.device) -> tuple[Any, Any]:
    """(read, sync): the clock a step's cost is measured with on this device (ns)."""
    if device.type == "cpu":
        return time.thread_time_ns, lambda: None
    if device.type == "cuda":
        return time.perf_counter_ns, torch.cuda.synchronize
    return time.perf_counter_ns, lambda: None


def _dummy_step(num_seqs: int, num_drafts: int, block_size: int) -> list[ScheduledSeq]:
    n = 1 + num_drafts
    blocks = [0] * ((_CONTEXT_TOKENS + n) // block_size + 1)
    sampling = SamplingConfig(max_tokens=1, temperature=0.0)
    return [
        ScheduledSeq(
            token_ids=[0] * n,
            start_pos=_CONTEXT_TOKENS,
            block_ids=blocks,
            sample=True,
            sampling=sampling,
            generator=None,
            num_logits=n,
            draw_seeds=(None,) * n,
        )
        for _ in range(num_seqs)
    ]


def calibrate(runner: Any, max_drafts: int, clock: tuple[Any, Any] | None = None) -> StepCost:
    """The step cost fitted to dummy steps of up to 8 sequences and max_drafts proposals each;
    `clock` = (read ns, synchronize), by default step_clock(runner.device)."""
    read, sync = clock or step_clock(runner.device)
    model = StepCostModel(decay=1.0)
    bs = runner.layout.block_size
    for num_seqs, drafts in _SHAPES:
        d = min(drafts, max_drafts)
        seqs = _dummy_step(num_seqs, d, bs)
        best = None
        for _ in range(_REPEATS):
            sync()
            t0 = read()
            runner.execute(seqs)
            sync()
            ns = read() - t0
            best = ns if best is None else min(best, ns)
        assert best is not None
        model.observe(num_seqs * (1 + d), num_seqs, best / 1e6)
    return model.cost
