"""The Engine facade: validates requests, routes them to their DP rank, and owns the ranks'
lifecycle (model replicas, KV pools, step threads). Implements services.worker.engine.api.Engine.

add_request / admit_remote must be called on a running asyncio loop: the returned handle
delivers its outputs on that loop. Every other method may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from services.worker.engine import cpu_linear
from services.worker.engine.api import (
    Admission,
    EngineConfig,
    EngineRequest,
    KvBlocksChunk,
    KvLayout,
    RankLoad,
    RequestHandle,
    RequestKind,
)
from services.worker.engine.build import RankBuilder
from services.worker.engine.detokenizer import (
    DetokenizedText,
    IncrementalDetokenizer,
    OutputText,
    hidden_token_ids,
)
from services.worker.engine.handle import OutputHandle
from services.worker.engine.lora import LoraSet, check_name, load_adapter, parse_lora_modules
from services.worker.engine.rank import Rank
from services.worker.engine.request import Request
from services.worker.engine.spec.draft import check_same_tokenizer
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.step_stats import StepStats
from services.worker.engine.structured import Grammars
from shared.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

log = logging.getLogger(__name__)

# Rank threads spend their time in torch ops, which release the GIL; taking it back after an op
# while another thread (the other ranks, the event loop) runs Python waits up to the switch
# interval (CPython default 5 ms), hundreds of times a step. 0.5 ms measured 127 -> ~97 ms per
# 8-sequence decode step with 2 ranks (SmolLM2, CPU).
_GIL_SWITCH_INTERVAL_S = 0.0005
_SPECULATIVE_METHODS = ("off", "ngram", "draft")


# alternatives per prompt token (SamplingConfig.prompt_logprobs; OpenAI's top logprobs limit)
MAX_PROMPT_LOGPROBS = 20


class PagedEngine:
    """Continuous batching over a paged KV cache, one step loop per DP rank."""

    def __init__(self, config: EngineConfig) -> None:
        if config.dp_size < 1:
            raise InvalidArgument("dp_size must be >= 1")
        if config.block_size < 1:
            raise InvalidArgument("block_size must be >= 1")
        if config.speculative not in _SPECULATIVE_METHODS:
            raise InvalidArgument(
                f"speculative must be one of {', '.join(_SPECULATIVE_METHODS)}, got {config.speculative!r}"
            )
        if config.num_speculative_tokens < 1:
            raise InvalidArgument("num_speculative_tokens must be >= 1")
        if not 1 <= config.spec_ngram_min <= config.spec_ngram_max:
            raise InvalidArgument("need 1 <= spec_ngram_min <= spec_ngram_max")
        if config.speculative == "draft" and not config.draft_model_path:
            raise InvalidArgument("speculative draft needs a draft model (--draft-model)")
        if config.draft_kv_cache_tokens < 0:
            raise InvalidArgument("draft_kv_cache_tokens must be >= 0")
        self.config = config
        self.model_id = Path(config.model_path).name
        self.kv_layout: KvLayout
        self.max_model_len = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self.tokenizer: Any = None
        self._grammars: Grammars | None = None  # structured outputs, built at first use
        self._hidden_ids: frozenset[int] = frozenset()
        self.vocab_size = 0
        # the LoRA adapters served besides the base model (--lora-modules, then those loaded at
        # run time), in the order loaded; replaced whole when one comes or goes
        self.lora_adapters: tuple[str, ...] = tuple(parse_lora_modules(config.lora_modules))
        self._lora_changes = threading.Lock()  # one load or unload at a time
        self._ranks: list[Rank] = []
        self._started = False
        self._stopped = False

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        from transformers import AutoTokenizer

        cfg = self.config
        sys.setswitchinterval(min(sys.getswitchinterval(), _GIL_SWITCH_INTERVAL_S))
        if cfg.torch_threads > 0:
            torch.set_num_threads(cfg.torch_threads)
        # before any model is loaded: packing the weights builds the first oneDNN kernels
        cpu_linear.bound_kernel_caches(cfg.cpu_kernel_cache_entries)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self._hidden_ids = hidden_token_ids(self.tokenizer)
        if cfg.speculative == "draft":
            try:
                draft_tokenizer = AutoTokenizer.from_pretrained(cfg.draft_model_path)
            except (OSError, ValueError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise InvalidArgument(f"cannot load draft model {cfg.draft_model_path}: {first}") from exc
            check_same_tokenizer(self.tokenizer, draft_tokenizer, cfg.draft_model_path)
        builder = RankBuilder(cfg, self.tokenizer, self.model_id)
        self._ranks = [builder.build(dp_rank) for dp_rank in range(cfg.dp_size)]
        self.kv_layout = builder.kv_layout
        self.max_model_len = builder.max_model_len
        self.eos_token_ids = builder.eos_token_ids
        self.vocab_size = builder.vocab_size
        for rank in self._ranks:
            rank.start()
        self._started = True

    def shutdown(self) -> None:
        self._stopped = True
        for rank in self._ranks:
            rank.stop()

    # ---- LoRA adapters at run time ----------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        check_name(name, "lora_name")
        if not self._started or self._stopped:
            raise FailedPrecondition("engine not started" if not self._started else "engine is shut down")
        if not (self.config.enable_lora or self.config.lora_modules):
            raise FailedPrecondition(
                "this worker does not serve LoRA adapters: start it with --enable-lora (or --lora-modules)"
            )
        with self._lora_changes:
            if name in self.lora_adapters or name == self.model_id:
                what = "the base model's id" if name == self.model_id else "loaded already"
                raise AlreadyExists(f"LoRA adapter name {name!r} is {what}")
            # every rank's copy first (the slow part: files, the device); nothing changes on error
            loaded = [
                load_adapter(name, path, r.runner.model, r.runner.device, r.runner.dtype) for r in self._ranks
            ]
            sets = [self._lora_set(r) for r in self._ranks]
            slots = [lora.add(adapter) for lora, adapter in zip(sets, loaded, strict=True)]
            with self._all_rank_locks():
                for lora, slot in zip(sets, slots, strict=True):
                    lora.publish(name, slot)
                self.lora_adapters = (*self.lora_adapters, name)
        log.info("LoRA adapter %s loaded from %s", name, path)

    def unload_lora_adapter(self, name: str) -> None:
        with self._lora_changes:
            if name not in self.lora_adapters:
                served = ", ".join(repr(n) for n in self.lora_adapters) or "none"
                raise NotFound(f"LoRA adapter {name!r} is not loaded on this worker (its adapters: {served})")
            sets = [self._lora_set(r) for r in self._ranks]
            with self._all_rank_locks():
                in_use = sum(r.lora_requests_locked(name) for r in self._ranks)
                if in_use:
                    raise FailedPrecondition(
                        f"LoRA adapter {name!r} has {in_use} request(s) queued or running on this "
                        "worker; unload it after they end"
                    )
                slots = [lora.unmap(name) for lora in sets]
                self.lora_adapters = tuple(n for n in self.lora_adapters if n != name)
            for lora, slot in zip(sets, slots, strict=True):
                lora.drop(slot)
        log.info("LoRA adapter %s unloaded", name)

    @staticmethod
    def _lora_set(rank: Rank) -> LoraSet:
        lora = rank.runner.lora
        assert lora is not None  # every rank has one when LoRA is enabled
        return lora

    @contextlib.contextmanager
    def _all_rank_locks(self) -> Iterator[None]:
        """Every rank's lock, in rank order (nothing else holds two)."""
        with contextlib.ExitStack() as stack:
            for rank in self._ranks:
                stack.enter_context(rank.lock)
            yield

    # ---- requests ------------------------------------------------------------------------
    def _validate(self, request: EngineRequest) -> Rank:
        """Everything the engine must never see is refused here, with a message that says what
        to change (the worker's servicer does not validate again)."""
        if not self._started or self._stopped:
            raise FailedPrecondition("engine not started" if not self._started else "engine is shut down")
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        num_ranks = len(self._ranks)
        if not 0 <= request.dp_rank < num_ranks:
            raise InvalidArgument(
                f"dp_rank {request.dp_rank} is out of range: this worker has {num_ranks} "
                f"rank(s), 0..{num_ranks - 1}"
            )
        n = len(request.prompt_token_ids)
        if n == 0:
            raise InvalidArgument("prompt_token_ids is empty")
        if n >= self.max_model_len:
            raise InvalidArgument(
                f"prompt has {n} tokens; this worker's max_model_len is {self.max_model_len}, "
                f"so prompts may have at most {self.max_model_len - 1}"
            )
        if any(not 0 <= t < self.vocab_size for t in request.prompt_token_ids):
            raise InvalidArgument(f"prompt token ids must be in [0, {self.vocab_size})")
        sp = request.sampling
        if sp.prompt_logprobs is not None and not 0 <= sp.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise InvalidArgument(
                f"sampling.prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {sp.prompt_logprobs}"
            )
        # max_tokens 0: only to score the prompt (prompt logprobs), never on a decode-only request
        scores_prompt = sp.prompt_logprobs is not None and request.kind is not RequestKind.DECODE_REMOTE
        if sp.max_tokens < (0 if scores_prompt else 1):
            raise InvalidArgument(
                "sampling.max_tokens must be >= 1 (0 only with prompt_logprobs, to score the prompt)"
            )
        if sp.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be >= 0, got {sp.temperature}")
        if not 0.0 < sp.top_p <= 1.0:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k < 0:
            raise InvalidArgument(f"sampling.top_k must be >= 0, got {sp.top_k}")
        if not 0.0 <= sp.min_p <= 1.0:  # NaN fails too
            raise InvalidArgument(f"sampling.min_p must be in [0, 1], got {sp.min_p}")
        ids = sp.allowed_token_ids
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            raise InvalidArgument(f"sampling.allowed_token_ids must be in [0, {self.vocab_size})")
        if any(not word or min(word) < 0 or max(word) >= self.vocab_size for word in sp.bad_words):
            raise InvalidArgument(
                f"sampling.bad_words must be non-empty token sequences of ids in [0, {self.vocab_size})"
            )
        tb = sp.thinking_budget
        tags = () if tb is None else (tb.start_token_ids, tb.end_token_ids)
        if any(not tag or min(tag) < 0 or max(tag) >= self.vocab_size for tag in tags):
            raise InvalidArgument(
                "sampling.thinking_budget's start and end tags must be non-empty token sequences of ids "
                f"in [0, {self.vocab_size})"
            )
        if sp.lora_adapter and sp.lora_adapter not in self.lora_adapters:
            served = ", ".join(repr(n) for n in self.lora_adapters) or "none"
            raise NotFound(
                f"LoRA adapter {sp.lora_adapter!r} is not loaded on this worker (its adapters: {served})"
            )
        for i, rank in enumerate(self._ranks):
            if i != request.dp_rank and rank.has_request(request.request_id):
                raise AlreadyExists(f"request {request.request_id!r} already exists")
        return self._ranks[request.dp_rank]

    def _new_request(self, request: EngineRequest, rank: Rank) -> tuple[Request, OutputHandle]:
        sp = request.sampling
        generator = None
        if sp.seed is not None and sp.temperature > 0:
            # seeded per draw from (seed, output index): Request.draw_seed
            generator = torch.Generator(device=rank.runner.device)
        text = DetokenizedText(
            IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                self._hidden_ids if sp.skip_special_tokens else frozenset(),
                unshown_tail=sp.unshown_tail_tokens,
            ),
            OutputText(sp.stop, sp.include_stop_in_output),
        )
        lora = rank.runner.lora
        adapter = sp.lora_adapter
        # an adapter unloaded meanwhile is refused when the rank registers the request
        lora_key = lora.cache_key(adapter) if adapter and lora is not None and lora.serves(adapter) else ""
        req = Request.from_engine_request(request, text, generator, lora_key)
        if sp.structured is not None:
            # a migrated request's prompt ends with its first_output_index generated tokens
            tail = min(sp.first_output_index, len(request.prompt_token_ids))
            replay = request.prompt_token_ids[len(request.prompt_token_ids) - tail :]
            req.grammar = self._structured_grammars().new_state(sp.structured, replay)
        return req, OutputHandle(request.request_id, asyncio.get_running_loop())

    def _structured_grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def add_request(self, request: EngineRequest) -> RequestHandle:
        if request.kind is RequestKind.DECODE_REMOTE:
            raise InvalidArgument("DECODE_REMOTE requests are admitted with admit_remote")
        rank = self._validate(request)
        req, handle = self._new_request(request, rank)
        rank.add(req, handle)
        return handle

    def admit_remote(
        self, request: EngineRequest, transfer_ticket: str | None = None
    ) -> tuple[Admission, RequestHandle]:
        if request.kind is not RequestKind.DECODE_REMOTE:
            raise InvalidArgument("admit_remote takes DECODE_REMOTE requests")
        rank = self._validate(request)
        if transfer_ticket is not None and self._ticket_rank(transfer_ticket) is not rank:
            raise InvalidArgument(
                f"transfer_ticket {transfer_ticket!r} must be '{request.dp_rank}-' followed by an "
                "id unique to the request (its rank, then a dash)"
            )
        req, handle = self._new_request(request, rank)
        return rank.handoff.admit_remote(req, handle, transfer_ticket), handle

    def waits_for_kv(self, transfer_ticket: str) -> bool:
        rank = self._ticket_rank(transfer_ticket)
        return rank is not None and rank.waits_for_kv(transfer_ticket)

    def _ticket_rank(self, ticket: str) -> Rank | None:
        """The rank a ticket ("<dp_rank>-<id>") names; None when it names none."""
        head, _, rest = ticket.partition("-")
        if rest and head.isdigit() and int(head) < len(self._ranks):
            return self._ranks[int(head)]
        return None

    def _rank_of_ticket(self, ticket: str) -> Rank:
        rank = self._ticket_rank(ticket)
        if rank is None:
            raise NotFound(f"unknown transfer ticket {ticket!r}")
        return rank

    def import_kv(self, transfer_ticket: str, chunk: KvBlocksChunk) -> None:
        self._rank_of_ticket(transfer_ticket).handoff.import_kv(transfer_ticket, chunk)

    def finish_import(
        self,
        transfer_ticket: str,
        num_tokens: int,
        first_token_id: int | None,
        prefill_generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> None:
        self._rank_of_ticket(transfer_ticket).handoff.finish_import(
            transfer_ticket, num_tokens, first_token_id, prefill_generated_tokens, draft_token_ids, recompute
        )

    def kv_pools(self) -> list[torch.Tensor]:
        return [rank.runner.kv_cache for rank in self._ranks]

    def export_block_ids(
        self, request_id: str, skip_blocks: int, end_block: int | None = None
    ) -> tuple[int, list[int]]:
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        return rank.dp_rank, rank.handoff.export_block_ids(request_id, skip_blocks, end_block)

    def request_preemptions(self, request_id: str) -> int:
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        with rank.lock:
            return rank.request(request_id).num_preemptions

    def import_kv_direct(
        self,
        transfer_ticket: str,
        first_block: int,
        num_blocks: int,
        read: Callable[[int, int, list[int], int, tuple[int, ...]], int],
    ) -> int:
        return self._rank_of_ticket(transfer_ticket).handoff.import_kv_direct(
            transfer_ticket, first_block, num_blocks, read
        )

    def _rank_of_request(self, request_id: str) -> Rank | None:
        for rank in self._ranks:
            if rank.has_request(request_id):
                return rank
        return None

    def export_kv(
        self, request_id: str, skip_blocks: int, max_chunk_bytes: int, trim_blocks: int = 0
    ) -> Iterator[KvBlocksChunk]:
        return self._export(request_id, skip_blocks, None, max_chunk_bytes, trim_blocks)

    def export_ready_kv(
        self, request_id: str, first_block: int, end_block: int, max_chunk_bytes: int, trim_blocks: int = 0
    ) -> Iterator[KvBlocksChunk]:
        return self._export(request_id, first_block, end_block, max_chunk_bytes, trim_blocks)

    def _export(
        self, request_id: str, first_block: int, end_block: int | None, max_chunk_bytes: int, trim_blocks: int
    ) -> Iterator[KvBlocksChunk]:
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        per_layer = rank.runner.bytes_per_block // rank.runner.layout.num_layers
        return itertools.chain.from_iterable(
            rank.handoff.iter_export(
                request_id,
                indices,
                max(1, max_chunk_bytes // (per_layer * len(layers or range(rank.runner.layout.num_layers)))),
                layers,
                end_block,
            )
            for indices, layers in rank.handoff.export_parts(request_id, first_block, trim_blocks, end_block)
        )

    def release(self, request_id: str) -> None:
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        rank.release(request_id)

    def abort(self, request_id: str) -> bool:
        return any(rank.abort(request_id) for rank in self._ranks)

    def abort_ticket(self, transfer_ticket: str) -> bool:
        rank = self._ticket_rank(transfer_ticket)
        return rank is not None and rank.abort_ticket(transfer_ticket)

    # ---- loads ---------------------------------------------------------------------------
    def rank_loads(self) -> list[RankLoad]:
        return [rank.load() for rank in self._ranks]

    def num_waiting_prompt_tokens(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].num_waiting_prompt_tokens()

    def num_free_blocks(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].num_free_blocks()

    def num_quarantined_blocks(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].handoff.num_quarantined_blocks

    def num_preemptions(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].num_preemptions()

    def kv_offload_stats(self, dp_rank: int) -> tuple[int, int, int, int] | None:
        return self._ranks[dp_rank].kv_offload_stats()

    def lora_requests(self, dp_rank: int) -> dict[str, int]:
        return self._ranks[dp_rank].lora_requests()

    def spec_stats(self, dp_rank: int) -> SpecStats:
        return self._ranks[dp_rank].spec_stats()

    def step_stats(self, dp_rank: int) -> StepStats:
        return self._ranks[dp_rank].steps()

    def draft_blocks(self, dp_rank: int) -> tuple[int, int]:
        """(free, total) blocks of the rank's draft-model KV pool; (0, 0) without one."""
        return self._ranks[dp_rank].draft_blocks()

    def num_total_blocks(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].blocks.num_blocks
