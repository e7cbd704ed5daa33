"""Per-request engine state: token ids, KV progress, block table, first-scheduling stats, the
status life (an allowed-transition table) and the one finish rule.

Counts are derived from the stored lists (never shadowed by counters). Status changes only through
the `Request` methods below, each checked against ALLOWED_TRANSITIONS (vLLM v1's RequestStatus is
the model). Output delivery (handles) lives in the rank; the detokenized text sits behind the small
`TextTracker` interface, so scheduling state is testable with `NoText()`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.worker.engine.api import EngineRequest, FinishReason, RequestKind, SamplingConfig, TokenLogprobs
from services.worker.engine.sampler import TokenHistory
from services.worker.engine.spec.policy import SpecRecord
from services.worker.engine.thinking_budget import ThinkingTracker
from shared.block_hash import chain_root

if TYPE_CHECKING:
    import torch

    from services.worker.engine.structured import GrammarState


class RequestStatus(enum.IntEnum):
    """Order means something: everything from FINISHED on no longer takes part in anything."""

    WAITING = 0  # queued for (first) prefill
    WAITING_FOR_KV = 1  # DECODE_REMOTE: blocks reserved, KV arriving through import_kv
    RUNNING = 2  # scheduled every step (prefill chunks, then decode steps)
    PREEMPTED = 3  # blocks freed, back at the front of the waiting queue (recomputes all)
    HELD = 4  # PREFILL_ONLY after its first token: blocks kept for export until release
    FINISHED = 5  # done, blocks freed (finish_reason says why; None for a released handoff)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
    RequestStatus.WAITING_FOR_KV: frozenset({RequestStatus.WAITING, RequestStatus.FINISHED}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED, RequestStatus.HELD, RequestStatus.FINISHED}),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
    RequestStatus.HELD: frozenset({RequestStatus.FINISHED}),
    RequestStatus.FINISHED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A bug: the request life tried a status change the table does not allow."""


def finish_rule(
    num_counted_tokens: int, max_tokens: int, stop_reason: FinishReason | None
) -> FinishReason | None:
    """The worker's one finish rule (docs/architecture.md "Token accounting"): a request whose
    count reached max_tokens finished by LENGTH, whatever else stopped it; else the stop reason
    (None: it goes on)."""
    if num_counted_tokens >= max_tokens:
        return FinishReason.LENGTH
    return stop_reason


class TextTracker(Protocol):
    """A request's detokenized output text and stop strings (detokenizer.DetokenizedText)."""

    def add_token(self, token_id: int, show: bool) -> bool:
        """Detokenize one appended token (its text kept only when `show`); True when a stop
        string appeared (the text is cut there)."""
        ...

    def take(self, final: bool) -> str:
        """Text not yet emitted (while running, holds back what may start a stop string)."""
        ...


class NoText:
    """A TextTracker for scheduling tests: no text, no stop strings."""

    def add_token(self, token_id: int, show: bool) -> bool:
        return False

    def take(self, final: bool) -> str:
        return ""


@dataclass(eq=False)
class Request:
    """One request on one rank. All fields are touched only under the rank's lock."""

    request_id: str
    kind: RequestKind
    sampling: SamplingConfig
    prompt_token_ids: tuple[int, ...]
    text: TextTracker = field(default_factory=NoText)
    generator: torch.Generator | None = None
    arrival_seq: int = 0  # set by the rank: newer requests are preempted first
    priority: int = 0  # lower is served first (EngineRequest.priority); ties: arrival order
    num_preemptions: int = 0  # times its blocks were freed to be computed again (count)
    _status: RequestStatus = RequestStatus.WAITING
    # prompt + tokens appended after it (for DECODE_REMOTE the first is the prefill's token)
    token_ids: list[int] = field(default_factory=list)
    # tokens at the start of the output that this engine did not sample (DECODE_REMOTE: 0 or 1)
    num_handoff_tokens: int = 0
    # tokens the prefill worker generated (DECODE_REMOTE); counted towards max_tokens
    num_prior_generated_tokens: int = 0
    num_computed_tokens: int = 0  # leading tokens whose K/V is in this request's blocks
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks whose chained hash is registered/known
    # leading blocks given back to the pool because they lie wholly behind every layer's
    # attention window (Scheduler.kv_window_tokens): their block_ids entries are no longer held
    # and are only ever read masked out (never hashed, exported or freed again)
    num_released_blocks: int = 0
    # leading prompt blocks of a DECODE_REMOTE request whose handoff was trimmed (kv_trim.py):
    # their windowed layers' K/V (every layer's, when all are windowed) never arrived here, so
    # they are never registered in the prefix cache
    num_trimmed_blocks: int = 0
    last_block_hash: int | None = None  # chain hash of block num_hashed_blocks - 1
    # where the request's hash chain starts: chain_root(sampling.cache_salt, sampling.lora_adapter)
    # (None: neither); last_block_hash while no block is hashed
    hash_root: int | None = None
    _finish_reason: FinishReason | None = None
    abort_requested: bool = False
    # first-scheduling stats: fixed once, never rewritten by preemption
    stats_fixed: bool = False
    num_local_cached_tokens: int = 0
    num_transferred_tokens: int = 0
    num_prefill_chunks: int = 0
    prefill_ns: int = 0
    transfer_ticket: str | None = None
    # a direct (NIXL) import writes into its blocks outside the rank's lock: they are freed only
    # after it ends, even when the request is aborted meanwhile
    kv_import_in_flight: bool = False
    # a direct import gave up on a transfer that may still write the blocks it targeted (they
    # are quarantined until it settles): a recompute must start over in fresh blocks
    kv_import_unsettled: bool = False
    # PREFILL_ONLY: an output after each prompt chunk but the last (EngineRequest's flag)
    report_prefill_progress: bool = False
    # output-delivery cursor: generated tokens already reported in a RequestOutput
    num_reported_tokens: int = 0
    # speculative decoding: proposals for the tokens after token_ids (verified next step; never
    # part of token_ids, never in a block once rejected) and this request's acceptance record
    spec_token_ids: list[int] = field(default_factory=list)
    spec: SpecRecord = field(default_factory=lambda: SpecRecord())  # replaced, never mutated
    # with sampling.logprobs: one entry per token this engine generated (num_generated_tokens)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # structured output: the matcher fed every output token (engine/structured.py)
    grammar: GrammarState | None = None
    # with sampling.prompt_logprobs: entry i for prompt token i + 1, computed by the prefill (a
    # preempted request that recomputes its prompt does not compute them again)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they left with an output (the first after the prefill)
    # with sampling.thinking_budget: its state, advanced over the output at each draw
    thinking: ThinkingTracker | None = None

    @classmethod
    def from_engine_request(
        cls,
        req: EngineRequest,
        text: TextTracker | None = None,
        generator: torch.Generator | None = None,
        lora_key: str = "",
    ) -> Request:
        """lora_key: what the request's adapter roots its hash chain at (LoraSet.cache_key);
        "" = its name."""
        status = (
            RequestStatus.WAITING_FOR_KV if req.kind is RequestKind.DECODE_REMOTE else RequestStatus.WAITING
        )
        return cls(
            request_id=req.request_id,
            kind=req.kind,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            text=text or NoText(),
            generator=generator,
            _status=status,
            token_ids=list(req.prompt_token_ids),
            report_prefill_progress=req.report_prefill_progress,
            priority=req.priority,
            hash_root=chain_root(req.sampling.cache_salt, lora_key or req.sampling.lora_adapter),
            last_block_hash=chain_root(req.sampling.cache_salt, lora_key or req.sampling.lora_adapter),
        )

    # ---- status: the only ways to change it ----------------------------------------------
    @property
    def status(self) -> RequestStatus:
        return self._status

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    def _transition(self, to: RequestStatus) -> None:
        if to not in ALLOWED_TRANSITIONS[self._status]:
            raise InvalidTransition(
                f"request {self.request_id!r}: {self._status.name} -> {to.name} is not allowed"
            )
        self._status = to

    def kv_arrived(self) -> None:
        """DECODE_REMOTE: every prompt block is in place; the request queues for decoding."""
        self._transition(RequestStatus.WAITING)

    def mark_running(self) -> None:
        """Admitted to the running batch (first time, or again after preemption)."""
        self._transition(RequestStatus.RUNNING)

    def preempt(self) -> None:
        """Its blocks were freed: it recomputes everything later; proposals are dropped."""
        self._transition(RequestStatus.PREEMPTED)
        self.num_preemptions += 1
        self.spec_token_ids = []

    def hold(self, reason: FinishReason | None) -> None:
        """PREFILL_ONLY after its first token: blocks kept for export; `reason` says whether
        the request already ended there (None: decoding continues elsewhere)."""
        self._transition(RequestStatus.HELD)
        self._finish_reason = reason

    def finish(self, reason: FinishReason) -> None:
        """Done (any status but HELD, which ends through `release`): blocks are being freed."""
        if self._status is RequestStatus.HELD:
            raise InvalidTransition(f"request {self.request_id!r}: a HELD request ends through release")
        self._transition(RequestStatus.FINISHED)
        self._finish_reason = reason
        self.spec_token_ids = []

    def release(self) -> None:
        """A HELD request's KV was exported (or abandoned): it ends with the reason it was held
        with."""
        if self._status is not RequestStatus.HELD:
            raise InvalidTransition(f"request {self.request_id!r}: release of a {self._status.name} request")
        self._transition(RequestStatus.FINISHED)

    # ---- tokens: the finish rule applied to each appended token --------------------------
    def append_output_token(
        self,
        token: int,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        logprobs: TokenLogprobs | None = None,
    ) -> FinishReason | None:
        """Apply the token-accounting and stop rules (api.py docstring) to one sampled token:
        a terminating EOS is neither appended nor counted; a stop token id is appended and
        counted (its text only when include_stop_in_output); a stop string cuts the text; a
        full context is LENGTH; and `finish_rule` puts max_tokens above everything."""
        sp = self.sampling
        stop: FinishReason | None = None
        if token in eos_token_ids and not sp.ignore_eos:
            stop = FinishReason.STOP  # not appended, not counted, no text
        else:
            self.token_ids.append(token)
            if logprobs is not None:
                self.output_logprobs.append(logprobs)
            if self.grammar is not None:
                self.grammar.accept(token)
            is_stop_token = token in sp.stop_token_ids
            hit = self.text.add_token(token, show=sp.include_stop_in_output or not is_stop_token)
            if is_stop_token or hit:
                stop = FinishReason.STOP
            elif self.num_tokens >= max_model_len:
                stop = FinishReason.LENGTH  # the model's context is full
        return finish_rule(self.num_counted_towards_max, sp.max_tokens, stop)

    def append_output_tokens(
        self,
        tokens: list[int],
        eos_token_ids: frozenset[int],
        max_model_len: int,
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> tuple[int, FinishReason | None]:
        """A run of tokens (accepted proposals + the bonus token), one at a time through the
        same rule; the first that finishes the request ends the run exactly there. Returns
        (tokens consumed, finish reason). `logprobs`: per token of the run, when asked for."""
        for i, token in enumerate(tokens):
            lp = logprobs[i] if i < len(logprobs) else None
            reason = self.append_output_token(token, eos_token_ids, max_model_len, lp)
            if reason is not None:
                return i + 1, reason
        return len(tokens), None

    def start_from_handoff(self, first_token_id: int) -> FinishReason | None:
        """DECODE_REMOTE: append the prefill worker's first token (not counted here) and replay
        the prefill side's text state, so stop strings can span the handoff and what the prefill
        worker already sent is not sent again. STOP when that token completed a stop string (an
        older prefill worker did not check it)."""
        self.token_ids.append(first_token_id)
        self.num_handoff_tokens = 1
        if self.grammar is not None:
            self.grammar.accept(first_token_id)
        if self.text.add_token(first_token_id, show=True):
            return FinishReason.STOP
        self.text.take(final=False)
        return None

    def draw_seed(self, offset: int = 0) -> int | None:
        """The seed of the draw for output index num_output_tokens + offset (None: unseeded).

        Each draw is seeded from (seed, output index), not from the generator's running state,
        so the token at output index k is the same wherever it is sampled: the decode worker's
        first draw after a handoff (index 1) equals a unified worker's second, a preempted
        request that recomputes draws the same noise again, and a position verified inside a
        speculative run draws what plain decoding would have drawn there."""
        if self.generator is None or self.sampling.seed is None:
            return None
        index = self.sampling.first_output_index + self.num_output_tokens + offset
        return _mix_seed(self.sampling.seed, index)

    def token_history(self, eos_token_ids: frozenset[int]) -> TokenHistory | None:
        """What the sampler needs for penalties, min_tokens, bad_words and a thinking budget at
        the next draw (None when the request uses none). The output index is draw_seed's: a
        migrated request's prompt ends with its first_output_index generated tokens, so they
        count as output here too (and in the thinking budget's count)."""
        sp = self.sampling
        if not sp.needs_history:
            return None
        stop_ids: tuple[int, ...] = ()
        if sp.min_tokens > 0:
            eos = () if sp.ignore_eos else tuple(sorted(eos_token_ids))
            stop_ids = eos + sp.stop_token_ids
        output_index = sp.first_output_index + self.num_output_tokens
        history = TokenHistory(tuple(self.token_ids), output_index, stop_ids)
        if sp.thinking_budget is None:
            return history
        if self.thinking is None:
            self.thinking = ThinkingTracker(sp.thinking_budget)
        state = self.thinking.state(history.output_token_ids)
        return dataclasses.replace(history, thinking_budget=sp.thinking_budget, thinking=state)

    # ---- prompt logprobs -----------------------------------------------------------------
    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet: the prefill computes every
        prompt token (no prefix-cache hits). Never for DECODE_REMOTE: its prefill worker has them."""
        return (
            self.sampling.prompt_logprobs is not None
            and self.kind is not RequestKind.DECODE_REMOTE
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def prompt_targets(self, start: int, num_tokens: int) -> tuple[int, tuple[int, ...]]:
        """For a chunk computing positions [start, start + num_tokens): (offset in the chunk of
        the first position whose prompt logprob is still missing, the prompt tokens that follow
        that position and the next ones); (0, ()) when the chunk needs none."""
        if not self.wants_prompt_logprobs:
            return 0, ()
        first = max(start, len(self.prompt_logprobs))
        end = min(start + num_tokens, self.num_prompt_tokens - 1)
        if first >= end:
            return 0, ()
        return first - start, self.prompt_token_ids[first + 1 : end + 1]

    def take_prompt_logprobs(self) -> tuple[TokenLogprobs, ...]:
        """The prompt logprobs, once, when they are complete (for the request's next output)."""
        if (
            self.prompt_logprobs_sent
            or self.sampling.prompt_logprobs is None
            or self.kind is RequestKind.DECODE_REMOTE
            or len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        ):
            return ()
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)

    # ---- derived counts ------------------------------------------------------------------
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

    @property
    def is_decoding(self) -> bool:
        """Its whole prompt is computed: each step computes its last token (+ proposals)."""
        return self.num_computed_tokens >= self.num_prompt_tokens


def _mix_seed(seed: int, index: int) -> int:
    """A 64-bit seed for draw `index` of a request seeded with `seed` (splitmix64 finalizer)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)
