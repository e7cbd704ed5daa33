"""A step's draws, from the logits rows the forward pass kept to each sequence's tokens: the
per-row sampling inputs (parameters, generators, seeds, histories, structured-output masks), the
draw on the logits' device (sampler.py), and the step's one device-to-host copy, now
(`sample_step`) or on its way while the host prepares the next step (`PendingSample`, async
scheduling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.worker.engine.sampler import apply_allowed, sample, sample_with_logprobs_to_host

if TYPE_CHECKING:
    from services.worker.engine.model_runner import ScheduledSeq


@dataclass
class PendingSample:
    """A step's drawn ids on their way to the host (async scheduling): on CUDA a non-blocking
    copy into pinned memory and an event recorded after it, so the host can prepare the next
    step meanwhile; on CPU the ids are already there."""

    ids: torch.Tensor  # [n] long on the device: the next step's input ids
    host: torch.Tensor  # [n] long on the host (pinned on CUDA), valid once `event` completed
    event: Any  # torch.cuda.Event, or None (CPU)
    seqs: list[ScheduledSeq]

    @staticmethod
    def start(ids: torch.Tensor, seqs: list[ScheduledSeq]) -> PendingSample:
        if ids.device.type != "cuda":
            return PendingSample(ids, ids, None, seqs)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(ids.device))
        return PendingSample(ids, host, event, seqs)

    def tokens(self) -> list[list[int]]:
        """Each seq's drawn token, once the step is done (waits for it: the step's one
        device-to-host copy)."""
        if self.event is not None:
            self.event.synchronize()
        return split([int(t) for t in self.host.tolist()], self.seqs)


def sampler_inputs(
    logits: torch.Tensor, sampled_seqs: list[ScheduledSeq]
) -> tuple[torch.Tensor, list[Any], list[Any], list[int | None], list[Any]]:
    """Per sampled row its parameters, generator, seed and history; logits with the structured
    outputs' masks applied."""
    params = [s.sampling for s in sampled_seqs for _ in range(s.num_logits)]
    gens = [s.generator for s in sampled_seqs for _ in range(s.num_logits)]
    seeds = [
        (s.draw_seeds[j] if j < len(s.draw_seeds) else None)
        for s in sampled_seqs
        for j in range(s.num_logits)
    ]
    histories = [
        (s.history.extended(s.token_ids[len(s.token_ids) - s.num_logits + 1 :][:j]) if s.history else None)
        for s in sampled_seqs
        for j in range(s.num_logits)
    ]
    if any(s.allowed is not None for s in sampled_seqs):
        masks = [
            s.allowed[j] if s.allowed is not None else None for s in sampled_seqs for j in range(s.num_logits)
        ]
        logits = apply_allowed(logits, masks)
    return logits, params, gens, seeds, histories


def draw(logits: torch.Tensor, sampled_seqs: list[ScheduledSeq]) -> torch.Tensor:
    """The drawn ids [sum of num_logits] on the logits' device (no logprobs: `sample_step`)."""
    logits, params, gens, seeds, histories = sampler_inputs(logits, sampled_seqs)
    return sample(logits, params, gens, seeds, histories)


def split(flat: list[int], sampled_seqs: list[ScheduledSeq]) -> list[list[int]]:
    """Flat drawn ids -> each sequence's num_logits tokens."""
    tokens: list[list[int]] = []
    pos = 0
    for s in sampled_seqs:
        tokens.append(flat[pos : pos + s.num_logits])
        pos += s.num_logits
    return tokens


def sample_step(logits: torch.Tensor, sampled_seqs: list[ScheduledSeq]) -> list[list[int]]:
    """logits [sum of num_logits, vocab], each sequence's rows in order -> its drawn tokens,
    each sequence's logprobs filled when asked. The step's one device-to-host copy: the drawn
    ids (with their logprobs, packed, when asked)."""
    if not any(s.sampling.logprobs is not None for s in sampled_seqs):
        return split([int(t) for t in draw(logits, sampled_seqs).tolist()], sampled_seqs)
    logits, params, gens, seeds, histories = sampler_inputs(logits, sampled_seqs)
    _, flat, logprobs = sample_with_logprobs_to_host(logits, params, gens, seeds, histories)
    pos = 0
    for s in sampled_seqs:
        s.logprobs = [lp for lp in logprobs[pos : pos + s.num_logits] if lp is not None]
        pos += s.num_logits
    return split(flat, sampled_seqs)
