"""The Engine facade: validates requests, routes them to their DP rank, and owns the ranks'
lifecycle (model replicas, KV pools, step threads). Implements services.worker.engine.api.Engine.

add_request / admit_remote must be called on a running asyncio loop: the returned handle
delivers its outputs on that loop. Every other method may be called from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from services.worker.engine import cpu_linear, memory, model_variants
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
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.detokenizer import (
    DetokenizedText,
    IncrementalDetokenizer,
    OutputText,
    hidden_token_ids,
)
from services.worker.engine.handle import OutputHandle
from services.worker.engine.kv_trim import KvTrim
from services.worker.engine.model_runner import (
    ModelRunner,
    kv_layout_of,
    load_model,
    resolve_dtype,
)
from services.worker.engine.rank import Rank, Speculation
from services.worker.engine.request import Request
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.spec.calibrate import calibrate
from services.worker.engine.spec.draft import DraftProposer, check_same_tokenizer, load_draft_model
from services.worker.engine.spec.ngram import NgramProposer
from services.worker.engine.spec.policy import StepCostModel
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.structured import Grammars
from shared.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

log = logging.getLogger(__name__)

# Rank threads spend their time in torch ops, which release the GIL; taking it back after an op
# while another thread (the other ranks, the event loop) runs Python waits up to the switch
# interval (CPython default 5 ms), hundreds of times a step. 0.5 ms measured 127 -> ~97 ms per
# 8-sequence decode step with 2 ranks (SmolLM2, CPU).
_GIL_SWITCH_INTERVAL_S = 0.0005
# Default per-step token budget by device type. A CPU core is compute-bound from ~64 rows on
# (SmolLM2 fp32: ~2.3 ms per token in the linear layers at 64 rows and at 2048), so larger
# chunks only stall running decodes longer (a 2048-token step takes ~6.5 s on one core, 512
# ~1.6 s); GPUs want big chunks to fill their cores.
_DEFAULT_BATCH_TOKENS = {"cpu": 512, "cuda": 2048}
# Default per-step cap on tokens while proposals are verified (the per-step back-off of
# speculation). On CPU every extra row costs compute: at 8 sequences with k=8 (SmolLM2 fp32, a
# loaded 2-core AVX2 machine, `make bench-spec`) a 64-token cap gave 1.03x and 32 gave 1.30x;
# a GPU stays memory-bound much longer.
_DEFAULT_SPEC_BATCH_TOKENS = {"cpu": 32, "cuda": 512}
# the start-up calibration counts as this many decode steps in the online step-cost fit
_STEP_COST_PRIOR_WEIGHT = 5.0
_SPECULATIVE_METHODS = ("off", "ngram", "draft")


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, (list, tuple)):
            ids.extend(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


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
        self._ranks: list[Rank] = []
        self._started = False
        self._stopped = False

    # ---- lifecycle -----------------------------------------------------------------------
    def _device_for(self, dp_rank: int) -> torch.device:
        want = self.config.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda":
            if not torch.cuda.is_available():
                raise FailedPrecondition("device cuda requested but CUDA is not available")
            gpus = torch.cuda.device_count()
            if dp_rank == gpus:  # once, at the first rank that shares a GPU
                # measured on one H200 (README, goodput on a GPU): two ranks of one process on one
                # GPU share a Python thread's launches, and TTFT collapsed under load
                log.warning(
                    "%d DP ranks on %d GPU(s): ranks share a GPU and its launching process; "
                    "prefer one rank per GPU, or more workers",
                    self.config.dp_size,
                    gpus,
                )
            return torch.device("cuda", dp_rank % gpus)
        return torch.device(want)

    def _graphs_on(self, device: torch.device) -> bool:
        """Whether decode steps on `device` replay as CUDA graphs (the target's and the draft's)."""
        return self.config.cuda_graphs and device.type == "cuda"

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
        for dp_rank in range(cfg.dp_size):
            device = self._device_for(dp_rank)
            dtype = resolve_dtype(cfg.dtype, device)
            cuda = device.type == "cuda"
            allocated_before = torch.cuda.memory_allocated(device) if cuda else 0
            try:
                model = load_model(
                    cfg.model_path, device, dtype, prepack=cfg.cpu_prepack, row_copy=cfg.cpu_row_copy
                )
            except torch.OutOfMemoryError:
                free, total = torch.cuda.mem_get_info(device)
                raise ResourceExhausted(
                    f"the model {self.model_id} does not fit on {device}: out of memory while loading it "
                    f"in {dtype} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
                ) from None
            if dp_rank == 0:
                text_cfg = model.config.get_text_config()
                self.kv_layout = kv_layout_of(model.config, cfg.block_size, dtype)
                self.max_model_len = cfg.max_model_len or int(text_cfg.max_position_embeddings)
                self.eos_token_ids = _eos_ids(model, self.tokenizer)
                self.vocab_size = int(text_cfg.vocab_size)
            draft_model: Any = None
            draft_layout: KvLayout | None = None
            if cfg.speculative == "draft":
                draft_model = load_draft_model(
                    cfg.draft_model_path, device, dtype, cfg.cpu_prepack, self.vocab_size, cfg.cpu_row_copy
                )
                draft_layout = kv_layout_of(draft_model.config, cfg.block_size, dtype)
            gpu = None
            if cuda and cfg.kv_cache_tokens == 0:
                prefill_tokens = cfg.max_batch_tokens or _DEFAULT_BATCH_TOKENS["cuda"]
                gpu = memory.measure_gpu(
                    model,
                    self.kv_layout,
                    device,
                    dtype,
                    allocated_before,
                    prefill_tokens,
                    cfg,
                    self.max_model_len,
                )
            num_blocks = memory.pool_blocks(
                cfg,
                self.max_model_len,
                [
                    self.kv_layout,
                    *([draft_layout] if draft_layout and cfg.draft_kv_cache_tokens == 0 else []),
                ],
                dtype,
                device,
                gpu,
            )
            runner = ModelRunner(
                model,
                self.kv_layout,
                num_blocks,
                device,
                dtype,
                lean_forward=cfg.lean_forward,
                decode_graphs=self._graphs_on(device),
                spec_tokens=cfg.num_speculative_tokens if cfg.speculative != "off" else 0,
                cpu_attention_kernel=cfg.cpu_attention_kernel,
                cuda_kernels=cfg.cuda_kernels,
                max_model_len=self.max_model_len,
            )
            runner.warm_up()
            self._prepare_graphs(runner, f"rank {dp_rank}")
            blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
            budget = cfg.max_batch_tokens or _DEFAULT_BATCH_TOKENS.get(device.type, 2048)
            speculation = None
            spec_tokens = 0
            if cfg.speculative == "ngram":
                speculation = Speculation(
                    NgramProposer(cfg.spec_ngram_min, cfg.spec_ngram_max), cfg.num_speculative_tokens
                )
            elif draft_model is not None and draft_layout is not None:
                speculation = Speculation(
                    self._draft_proposer(draft_model, draft_layout, num_blocks, device, dtype, budget),
                    cfg.num_speculative_tokens,
                )
            if speculation is not None:
                spec_tokens = cfg.spec_max_batch_tokens or _DEFAULT_SPEC_BATCH_TOKENS.get(device.type, 512)
            scheduler = Scheduler(
                blocks,
                budget,
                cfg.max_num_seqs,
                spec_tokens,
                model_variants.kv_window_tokens(model.config),
                KvTrim.of(model_variants.attention_windows(model.config)),
            )
            if speculation is not None and cfg.spec_step_cost:
                prior = calibrate(runner, cfg.num_speculative_tokens)
                log.info("rank %d step cost (calibrated): %s", dp_rank, prior)
                scheduler.step_cost = StepCostModel(prior, prior_weight=_STEP_COST_PRIOR_WEIGHT)
            self._ranks.append(
                Rank(
                    dp_rank,
                    runner,
                    blocks,
                    scheduler,
                    self.eos_token_ids,
                    self.max_model_len,
                    self.vocab_size,
                    speculation,
                )
            )
            log.info(
                "rank %d ready: %s %s, %d KV blocks of %d tokens",
                dp_rank,
                device,
                dtype,
                num_blocks,
                cfg.block_size,
            )
        for rank in self._ranks:
            rank.start()
        self._started = True

    def _prepare_graphs(self, runner: ModelRunner, what: str) -> None:
        """Capture the runner's CUDA graphs now (decode_graphs.py), not while serving."""
        if runner.graphs is None:
            return
        t0 = time.perf_counter()
        n = runner.graphs.prepare(self.config.max_num_seqs, self.config.cuda_graph_warm_tokens)
        log.info("%s: %d CUDA graphs captured in %.1f s", what, n, time.perf_counter() - t0)

    def _draft_proposer(
        self,
        model: Any,
        layout: KvLayout,
        target_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_tokens: int,
    ) -> DraftProposer:
        """The draft model's runner and its own KV pool: draft_kv_cache_tokens, else as many
        tokens as the target's pool (every token the target holds, the draft can hold)."""
        cfg = self.config
        num_blocks = (
            -(-cfg.draft_kv_cache_tokens // cfg.block_size) if cfg.draft_kv_cache_tokens else target_blocks
        )
        runner = ModelRunner(
            model,
            layout,
            num_blocks,
            device,
            dtype,
            lean_forward=cfg.lean_forward,
            # its proposal steps (1 row) and catch-up steps (up to k + 1 rows)
            decode_graphs=self._graphs_on(device),
            spec_tokens=cfg.num_speculative_tokens,
            cpu_attention_kernel=cfg.cpu_attention_kernel,
            cuda_kernels=cfg.cuda_kernels,
            max_model_len=self.max_model_len,
        )
        runner.warm_up()
        self._prepare_graphs(runner, "draft model")
        max_len = min(self.max_model_len, int(model.config.get_text_config().max_position_embeddings))
        log.info(
            "draft model %s: %d KV blocks of %d tokens", cfg.draft_model_path, num_blocks, cfg.block_size
        )
        return DraftProposer(
            runner,
            BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching),
            max_catchup_tokens=max_batch_tokens,
            max_model_len=max_len,
            vocab_size=self.vocab_size,
        )

    def shutdown(self) -> None:
        self._stopped = True
        for rank in self._ranks:
            rank.stop()

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
                self._hidden_ids,
                unshown_tail=sp.unshown_tail_tokens,
            ),
            OutputText(sp.stop, sp.include_stop_in_output),
        )
        req = Request.from_engine_request(request, text, generator)
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

    def admit_remote(self, request: EngineRequest) -> tuple[Admission, RequestHandle]:
        if request.kind is not RequestKind.DECODE_REMOTE:
            raise InvalidArgument("admit_remote takes DECODE_REMOTE requests")
        rank = self._validate(request)
        req, handle = self._new_request(request, rank)
        return rank.admit_remote(req, handle), handle

    def _rank_of_ticket(self, ticket: str) -> Rank:
        head = ticket.split("-", 1)[0]
        if head.isdigit() and int(head) < len(self._ranks):
            return self._ranks[int(head)]
        raise NotFound(f"unknown transfer ticket {ticket!r}")

    def import_kv(self, transfer_ticket: str, chunk: KvBlocksChunk) -> None:
        self._rank_of_ticket(transfer_ticket).import_kv(transfer_ticket, chunk)

    def finish_import(
        self,
        transfer_ticket: str,
        num_tokens: int,
        first_token_id: int | None,
        prefill_generated_tokens: int,
        draft_token_ids: tuple[int, ...] = (),
        recompute: bool = False,
    ) -> None:
        self._rank_of_ticket(transfer_ticket).finish_import(
            transfer_ticket, num_tokens, first_token_id, prefill_generated_tokens, draft_token_ids, recompute
        )

    def kv_pools(self) -> list[torch.Tensor]:
        return [rank.runner.kv_cache for rank in self._ranks]

    def export_block_ids(self, request_id: str, skip_blocks: int) -> tuple[int, list[int]]:
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        return rank.dp_rank, rank.export_block_ids(request_id, skip_blocks)

    def import_kv_direct(
        self,
        transfer_ticket: str,
        first_block: int,
        num_blocks: int,
        read: Callable[[int, int, list[int], int, tuple[int, ...]], int],
    ) -> int:
        return self._rank_of_ticket(transfer_ticket).import_kv_direct(
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
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        per_layer = rank.runner.bytes_per_block // rank.runner.layout.num_layers
        return itertools.chain.from_iterable(
            rank.iter_export(
                request_id,
                indices,
                max(1, max_chunk_bytes // (per_layer * len(layers or range(rank.runner.layout.num_layers)))),
                layers,
            )
            for indices, layers in rank.export_parts(request_id, skip_blocks, trim_blocks)
        )

    def release(self, request_id: str) -> None:
        rank = self._rank_of_request(request_id)
        if rank is None:
            raise NotFound(f"unknown request {request_id!r}")
        rank.release(request_id)

    def abort(self, request_id: str) -> bool:
        return any(rank.abort(request_id) for rank in self._ranks)

    # ---- loads ---------------------------------------------------------------------------
    def rank_loads(self) -> list[RankLoad]:
        return [rank.load() for rank in self._ranks]

    def num_waiting_prompt_tokens(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].num_waiting_prompt_tokens()

    def num_free_blocks(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].num_free_blocks()

    def num_preemptions(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].num_preemptions()

    def spec_stats(self, dp_rank: int) -> SpecStats:
        return self._ranks[dp_rank].spec_stats()

    def draft_blocks(self, dp_rank: int) -> tuple[int, int]:
        """(free, total) blocks of the rank's draft-model KV pool; (0, 0) without one."""
        return self._ranks[dp_rank].draft_blocks()

    def num_total_blocks(self, dp_rank: int) -> int:
        return self._ranks[dp_rank].blocks.num_blocks
