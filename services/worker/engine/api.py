"""The engine's contract with the worker servicer: requests in, per-request outputs out, KV export
and import for disaggregation, per-rank loads. No grpc here.

Threading: the engine runs one step loop per DP rank in background threads. Every method below is
safe to call from the asyncio event loop thread; outputs are delivered to the caller's loop.

Token accounting rules (docs/architecture.md "Token accounting"):
- `num_generated_tokens` is the authoritative per-request counter of tokens this engine sampled
  for the request, excluding a terminating model EOS (so an immediate EOS counts 0); a token from
  `stop_token_ids` that ends the request IS counted (its text is excluded unless
  `include_stop_in_output`).
- finish reason: `num_generated_tokens >= max_tokens` -> LENGTH, else the stop reason.
- For a DECODE_REMOTE request the first token was sampled (and counted, and its text emitted) by
  the prefill worker: this engine counts only what it samples after the handoff, and its
  incremental detokenizer consumes the first token silently so text continues seamlessly.
- `num_local_cached_tokens` / `num_transferred_tokens` are fixed when the request is first
  scheduled (or the KV import completes) and never rewritten by preemption.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

# The cluster types this contract speaks in (defined once, in shared.cluster).
from services.worker.engine.options import EngineOptions
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.step_stats import StepStats
from services.worker.engine.thinking_budget import ThinkingBudget
from shared.cluster import FinishReason, KvLayout, RankLoad
from shared.structured_output import StructuredOutput


class RequestKind(enum.Enum):
    # Prefill + decode here (unified worker, or local prefill on a decode worker).
    FULL = "full"
    # Prefill, sample the first token, then hold the KV blocks until `release` (after export).
    PREFILL_ONLY = "prefill_only"
    # Reserve blocks now; KV arrives through `import_kv`; decoding starts at `finish_import`.
    DECODE_REMOTE = "decode_remote"


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = disabled
    top_k: int = 0  # 0 = disabled
    # vLLM's cache_salt: the request's prefix-cache blocks are keyed under it (shared.block_hash
    # .salt_root), so they never match another salt's or an unsalted request's; "" = none
    cache_salt: str = ""
    # the LoRA adapter serving the request (a name of EngineOptions.lora_modules); "" = the base
    # model. Its blocks are keyed under it too (shared.block_hash.chain_root)
    lora_adapter: str = ""
    # vLLM's skip_special_tokens: False shows the text of special tokens in the output (a
    # terminating EOS never has any); True hides them (detokenizer.hidden_token_ids)
    skip_special_tokens: bool = True
    # min-p: after temperature, tokens less likely than min_p x the most likely one are dropped
    # (before top-k / top-p, vLLM's order); 0 = disabled, in [0, 1]
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_in_output: bool = False
    # output index of this request's first generated token (a migrated request continues there)
    first_output_index: int = 0
    # trailing prompt tokens whose text was never shown (a migrated request's incomplete character)
    unshown_tail_tokens: int = 0
    # OpenAI penalties over the output tokens (a migrated request's generated prompt tail
    # included): logit -= frequency_penalty * count + presence_penalty * (count > 0); 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/HF repetition penalty over prompt + output tokens: a seen token's logit is divided by
    # it when positive, multiplied when negative; 1 = off
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits before penalties (OpenAI logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # EOS (unless ignore_eos) and stop_token_ids cannot be drawn before this output index
    min_tokens: int = 0
    # vLLM's allowed_token_ids: only these ids may be drawn (every other logit -inf, at every
    # draw); sorted, no duplicates; () = no restriction
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as token sequences (tokenized by the gateway): the last token of each is
    # banned at a draw whose output so far ends with the rest of it (a one-token one always)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's thinking_token_budget with the thinking tags' ids (engine/thinking_budget.py): once
    # that many tokens were generated inside the thinking section, the closing tag is forced;
    # None = no limit
    thinking_budget: ThinkingBudget | None = None
    # per generated token: its log-probability and this many most likely alternatives (0-20)
    # under the distribution the sampler drew from (sampler.py); None = no logprobs
    logprobs: int | None = None
    # the output must match this (engine/structured.py); None = unconstrained
    structured: StructuredOutput | None = None
    # per prompt token after the first: its log-probability and this many most likely
    # alternatives (0-20) under the raw model distribution (log_softmax of the model's logits:
    # no temperature, penalties, bias or grammar, as vLLM's prompt logprobs). The prefill
    # computes the whole prompt for them (its prefix-cache hits are not used) and they come with
    # the request's first output; with them max_tokens may be 0 (nothing is generated: the
    # request ends after its prefill with LENGTH). None = no prompt logprobs
    prompt_logprobs: int | None = None

    @functools.cached_property
    def allowed_ids_tensor(self) -> torch.Tensor:
        """allowed_token_ids as a host long tensor, built once per request (the sampler masks
        every draw with it; a list of a whole vocabulary costs milliseconds to convert)."""
        import torch

        return torch.tensor(self.allowed_token_ids, dtype=torch.long)

    @property
    def needs_history(self) -> bool:
        """The sampler needs the request's tokens (penalties, min_tokens, bad_words or a
        thinking budget are on)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
            or bool(self.bad_words)
            or self.thinking_budget is not None
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated (or prompt) token's log-probability, its rank and the most likely tokens at
    its position (most likely first; natural log; -inf for a token top-k / top-p ruled out)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), SamplingConfig.logprobs of them
    # 1-based rank of token_id in the distribution `logprob` comes from: 1 + the tokens with a
    # strictly greater logprob (vLLM's); None where it was not computed
    rank: int | None = None


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig
    dp_rank: int = 0
    kind: RequestKind = RequestKind.FULL
    # PREFILL_ONLY: also yield an output (finished=False, no tokens) after each prompt chunk but
    # the last, whose num_computed_tokens says how much KV is ready (the early handoff's cue)
    report_prefill_progress: bool = False
    # scheduling priority (vLLM's convention: lower is served first; 0 = default): the rank's
    # waiting queue is ordered by it, and under KV pressure the lowest is preempted first
    priority: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """What changed for one request in one step (or the terminal event).

    new_token_ids never contains a terminating EOS (it is not counted either). A PREFILL_ONLY
    request's handle yields one output, finished=True, after its first token (after one
    progress output per earlier prompt chunk with EngineRequest.report_prefill_progress): its
    finish_reason is STOP/LENGTH when the request ended there (EOS, stop, max_tokens, context
    full), else None (decoding continues elsewhere; the KV is held until `release`)."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled since the previous output (may be empty)
    text_delta: str  # detokenized text since the previous output ("" while a char is partial)
    finished: bool
    finish_reason: FinishReason | None  # set iff finished
    num_generated_tokens: int  # authoritative running count (see module docstring)
    num_prompt_tokens: int
    num_local_cached_tokens: int
    num_transferred_tokens: int
    num_prefill_chunks: int = 0  # prefill chunks run for this request so far (count)
    prefill_ns: int = 0  # time in prefill forward passes for this request (nanoseconds)
    # PREFILL_ONLY handoff with speculation on: proposals for the tokens after the first token,
    # for the decode worker's first step to verify (token ids; empty = none)
    draft_token_ids: tuple[int, ...] = ()
    # with SamplingConfig.logprobs: one entry per new_token_ids token, in order
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    # with SamplingConfig.prompt_logprobs, on the first output after the prefill only: one entry
    # per prompt token from the second on (the first has no logprob: nothing precedes it)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # leading tokens whose K/V is computed in the request's blocks (tokens; set on a PREFILL_ONLY
    # request's progress outputs, EngineRequest.report_prefill_progress)
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class Admission:
    """A DECODE_REMOTE request admitted: blocks for the whole prompt are reserved."""

    request_id: str
    transfer_ticket: str
    num_cached_blocks: int  # leading full prompt blocks already in this rank's prefix cache
    num_local_cached_tokens: int
    # leading prompt blocks wholly behind every sliding window at the first decode position
    # (engine/kv_trim.py): of these only the full-attention layers' K/V is needed (none when
    # every layer is windowed); 0 = every block is needed whole
    num_trim_blocks: int = 0


@dataclass(frozen=True)
class KvBlocksChunk:
    """Serialized KV of blocks [first_block, first_block + num_blocks) of one request.

    data: for each block, for each layer (of `layers`, when set), K then V, each
    [num_kv_heads, block_size, head_dim] in the layout dtype, C order (the layout described in
    worker.proto's KvChunk)."""

    first_block: int
    num_blocks: int
    data: bytes
    # the layers data holds, ascending (a trimmed handoff: engine/kv_trim.py); () = every layer
    layers: tuple[int, ...] = ()


class KvReadUnsettled(Exception):
    """A direct KV import's read gave up (timed out) while its transfer may still write the
    target blocks: the transport could not cancel it. The engine keeps those blocks out of the
    free pool (a quarantine) until `on_settled`'s callback runs: the transfer is then over (done
    or failed), so nothing can land in a block another request was given. The transport calls
    each callback once, from any thread; one registered after the end runs at once."""

    def on_settled(self, callback: Callable[[], None]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class EngineConfig(EngineOptions):
    """What an engine runs: the model and where, plus every option of options.EngineOptions
    (the backend's, speculation's, batch and pool sizes; their help texts are there)."""

    model_path: str = field(kw_only=True)
    device: str = "cpu"  # "cpu" | "cuda" | "auto"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16" | "auto"
    kv_memory_fraction: float = 0.3  # CPU: of free host memory, when kv_cache_tokens == 0
    enable_prefix_caching: bool = True
    # speculative "draft": the draft model's folder (same tokenizer as the target)
    draft_model_path: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def engine_options(source: EngineOptions, **changes: Any) -> dict[str, Any]:
    """The EngineOptions fields of `source` (e.g. a worker's settings) as keyword arguments of
    EngineConfig, with `changes` applied: a config embeds the options, never copies them by
    hand."""
    values = {f.name: getattr(source, f.name) for f in fields(EngineOptions)}
    values.update(changes)
    return values


class RequestHandle(Protocol):
    """Outputs of one request, in order; ends after the output with finished=True."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class Engine(Protocol):
    config: EngineConfig
    model_id: str
    kv_layout: KvLayout
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # the LoRA adapters served besides the base model (EngineOptions.lora_modules' names)
    lora_adapters: tuple[str, ...]

    def start(self) -> None:
        """Load model replicas, allocate pools, run a warm-up step, start the step loops."""

    def shutdown(self) -> None:
        """Abort everything, stop the step loops."""

    def add_request(self, request: EngineRequest) -> RequestHandle:
        """Queue a FULL or PREFILL_ONLY request. Raises shared.errors.InvalidArgument (bad rank,
        prompt too long for max_model_len, empty prompt) or ResourceExhausted (can never fit)."""

    def admit_remote(
        self, request: EngineRequest, transfer_ticket: str | None = None
    ) -> tuple[Admission, RequestHandle]:
        """Admit a DECODE_REMOTE request: reserve blocks, look up the prefix cache, register it
        under `transfer_ticket` (the gateway's choice: "<dp_rank>-..." of the request's rank,
        unused; InvalidArgument / AlreadyExists otherwise) or a ticket of its own (None)."""

    def waits_for_kv(self, transfer_ticket: str) -> bool:
        """Whether a request admitted under this ticket waits for its KV."""

    def import_kv(self, transfer_ticket: str, chunk: KvBlocksChunk) -> None:
        """Write received blocks into the reserved blocks. NotFound for an unknown ticket."""

    def finish_import(
        self,
        transfer_ticket: str,
        num_tokens: int,
        first_token_id: int | None,
        prefill_generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> None:
        """All KV arrived: the request joins the decode batch after the first token; with
        speculation on, its first step verifies the prefill worker's `draft_token_ids`.
        recompute: the KV did NOT arrive (a failed transfer): the request keeps the first token
        and recomputes its prompt here (as after a preemption), nothing of the import is kept."""

    def kv_pools(self) -> list[torch.Tensor]:
        """Each rank's KV pool [layers, 2, kv_heads, slots, head_dim] (to register for NIXL)."""

    def export_block_ids(
        self, request_id: str, skip_blocks: int, end_block: int | None = None
    ) -> tuple[int, list[int]]:
        """(dp_rank, pool block ids) of a finished PREFILL_ONLY request's prompt blocks from
        skip_blocks on; they stay valid until `release` (the request holds them). With
        end_block, those before it of a prefill still running, like export_ready_kv (valid
        while it runs: a preemption frees them, and the request computes them again in blocks
        that may differ; InvalidArgument when they are not computed)."""

    def request_preemptions(self, request_id: str) -> int:
        """How often the request's blocks were freed to be computed again (count): a change
        tells an early KV export that blocks it named may have held other data meanwhile."""

    def import_kv_direct(
        self,
        transfer_ticket: str,
        first_block: int,
        num_blocks: int,
        read: Callable[[int, int, list[int], int, tuple[int, ...]], int],
    ) -> int:
        """Fill the reserved blocks [first_block, first_block + num_blocks) of the request by
        read(source_offset, dp_rank, pool_block_ids, num_trimmed, layers) (the blocks it already
        holds from its own prefix cache, and those it released behind every window, are skipped:
        source_offset says how many; the first num_trimmed of pool_block_ids are read only in
        `layers`, the full-attention ones); returns read's bytes. An abort cannot free the blocks
        while they are written; when read raises KvReadUnsettled the blocks it targeted are
        quarantined until that transfer settles (and a recompute of the request starts over in
        fresh blocks)."""

    def export_ready_kv(
        self, request_id: str, first_block: int, end_block: int, max_chunk_bytes: int, trim_blocks: int = 0
    ) -> Iterator[KvBlocksChunk]:
        """Like export_kv, blocks [first_block, end_block) of a PREFILL_ONLY request still in its
        prefill: only blocks whose every token's K/V is computed (a progress output's
        num_computed_tokens // block_size; they never change after). Raises InvalidArgument when
        they are not (any more: the request was preempted and recomputes)."""

    def export_kv(
        self, request_id: str, skip_blocks: int, max_chunk_bytes: int, trim_blocks: int = 0
    ) -> Iterator[KvBlocksChunk]:
        """Serialized KV of a finished PREFILL_ONLY request's prompt blocks from skip_blocks on
        (the last block may be partial: it carries num_prompt_tokens % block_size valid rows);
        of the first trim_blocks (the decode side's Admission.num_trim_blocks) only the
        full-attention layers, nothing when every layer is windowed."""

    def release(self, request_id: str) -> None:
        """Free a PREFILL_ONLY request's held blocks (they stay in the prefix cache)."""

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state and free its blocks; its handle ends with ABORT.
        Returns False when unknown."""

    def abort_ticket(self, transfer_ticket: str) -> bool:
        """Abort the DECODE_REMOTE request still waiting for its KV under this ticket (its
        handoff broke); False when no request waits under it."""

    def rank_loads(self) -> list[RankLoad]: ...

    def num_free_blocks(self, dp_rank: int) -> int: ...

    def num_total_blocks(self, dp_rank: int) -> int: ...

    def num_quarantined_blocks(self, dp_rank: int) -> int:
        """Blocks held back until a timed-out direct READ into them settles (handoff.py)."""

    def num_waiting_prompt_tokens(self, dp_rank: int) -> int:
        """Tokens queued for prefill on the rank (waiting requests + rest of chunked prompts)."""

    def num_preemptions(self, dp_rank: int) -> int:
        """Requests preempted by recompute on the rank since start (count)."""

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` on every rank (blocking: seconds for a large
        adapter; call it off the event loop); steps go on meanwhile and requests may name it once
        it returns. InvalidArgument: a malformed name; AlreadyExists: `name` is loaded (or is
        the base model's id); FailedPrecondition: LoRA is not enabled (--enable-lora), or the
        adapter cannot serve this model (the reason). Nothing changes on any rank on error."""

    def unload_lora_adapter(self, name: str) -> None:
        """Unload `name` from every rank (waits for a load in progress: call it off the event
        loop too). NotFound: not loaded; FailedPrecondition: requests of it are still queued or
        running (unload after they end)."""

    def lora_requests(self, dp_rank: int) -> dict[str, int]:
        """The rank's unfinished requests by LoRA adapter (queued, running or held; adapters
        without any and the base model left out)."""

    def kv_offload_stats(self, dp_rank: int) -> tuple[int, int, int, int] | None:
        """The host KV tier's (blocks saved, blocks restored since start, blocks held, capacity
        in blocks); None when the rank has none (--kv-offload-tokens 0)."""

    def spec_stats(self, dp_rank: int) -> SpecStats:
        """Speculative-decoding counters of the rank since start (a copy)."""

    def step_stats(self, dp_rank: int) -> StepStats:
        """The rank's steps by kind since start: count, wall time, tokens (a copy)."""
