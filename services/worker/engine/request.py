"""Per-request engine state: token ids, KV progress, block table and first-scheduling stats.

Counts are derived from the stored lists (never shadowed by counters). The status order means
something: everything after PREEMPTED no longer takes part in scheduling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.engine.api import EngineRequest, FinishReason, RequestKind, SamplingConfig

if TYPE_CHECKING:
    import torch

    from services.worker.engine.detokenizer import IncrementalDetokenizer, OutputText
    from services.worker.engine.handle import OutputHandle


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued for (re)prefill
    WAITING_FOR_KV = 1  # DECODE_REMOTE: blocks reserved, KV arriving through import_kv
    RUNNING = 2  # scheduled every step (prefill chunks, then one decode token per step)
    PREEMPTED = 3  # blocks freed, back at the front of the waiting queue (recomputes all)
    HELD = 4  # PREFILL_ONLY after its first token: blocks kept for export until release
    FINISHED = 5  # done, blocks freed (finish_reason says why)


@dataclass(eq=False)
class Request:
    """One request on one rank. All fields are touched only under the rank's lock."""

    request_id: str
    kind: RequestKind
    sampling: SamplingConfig
    prompt_token_ids: tuple[int, ...]
    handle: OutputHandle
    detokenizer: IncrementalDetokenizer
    text: OutputText
    generator: torch.Generator | None
    arrival_seq: int  # monotonically increasing per rank: newer requests are preempted first
    status: RequestStatus = RequestStatus.WAITING
    # prompt + tokens appended after it (for DECODE_REMOTE the first is the prefill's token)
    token_ids: list[int] = field(default_factory=list)
    # tokens at the start of the output that this engine did not sample (DECODE_REMOTE: 0 or 1)
    num_handoff_tokens: int = 0
    # tokens the prefill worker generated (DECODE_REMOTE); counted towards max_tokens
    num_prior_generated_tokens: int = 0
    num_computed_tokens: int = 0  # leading tokens whose K/V is in this request's blocks
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks whose chained hash is registered/known
    last_block_hash: int | None = None  # chain hash of block num_hashed_blocks - 1
    finish_reason: FinishReason | None = None
    abort_requested: bool = False
    # first-scheduling stats: fixed once, never rewritten by preemption
    stats_fixed: bool = False
    num_local_cached_tokens: int = 0
    num_transferred_tokens: int = 0
    num_prefill_chunks: int = 0
    prefill_ns: int = 0
    transfer_ticket: str | None = None
    # output-delivery cursor: generated tokens already reported in a RequestOutput
    num_reported_tokens: int = 0

    @classmethod
    def from_engine_request(
        cls, req: EngineRequest, handle: OutputHandle, detokenizer: IncrementalDetokenizer,
        text: OutputText, generator: torch.Generator | None, arrival_seq: int,
    ) -> Request:
        return cls(
            request_id=req.request_id, kind=req.kind, sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids, handle=handle, detokenizer=detokenizer,
            text=text,
            generator=generator, arrival_seq=arrival_seq,
            token_ids=list(req.prompt_token_ids),
        )

    def generator_for_next_token(self) -> torch.Generator | None:
        """The seeded generator, positioned for the output token about to be sampled.

        Each draw is seeded from (seed, output index), not from the generator's running state,
        so the token at output index k is the same wherever it is sampled: the decode worker's
        first draw after a handoff (index 1) equals a unified worker's second, and a preempted
        request that recomputes draws the same noise again."""
        if self.generator is None or self.sampling.seed is None:
            return self.generator
        self.generator.manual_seed(_mix_seed(self.sampling.seed, self.num_output_tokens))
        return self.generator

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens this engine sampled and counted (a terminating EOS is never appended)."""
        return self.num_output_tokens - self.num_handoff_tokens

    @property
    def num_counted_towards_max(self) -> int:
        return self.num_generated_tokens + self.num_prior_generated_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


def _mix_seed(seed: int, index: int) -> int:
    """A 64-bit seed for draw `index` of a request seeded with `seed` (splitmix64 finalizer)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)
