"""Start-up of an engine's ranks: per DP rank its device and model backend (backend.py), the
model loaded for it, the KV pool sized (memory.py), the model runner warmed up and its CUDA
graphs captured, the block manager, scheduler and speculation (a draft model gets its own
runner and pool). The model's facts (KV layout, max_model_len, EOS ids, vocabulary) are read
from rank 0."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from services.worker.engine import fp8, memory, model_variants
from services.worker.engine.api import EngineConfig, KvLayout
from services.worker.engine.backend import ModelBackend
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.gpu_placement import rank_gpu, worker_gpus
from services.worker.engine.kv_offload import HostKvCache
from services.worker.engine.kv_trim import KvTrim
from services.worker.engine.lora import LoraSet, parse_lora_modules
from services.worker.engine.model_loading import kv_layout_of, load_model, resolve_dtype
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.rank import Rank
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.spec.calibrate import calibrate
from services.worker.engine.spec.draft import DraftProposer, load_draft_model
from services.worker.engine.spec.ngram import NgramProposer
from services.worker.engine.spec.policy import StepCostModel
from services.worker.engine.spec.speculation import NoSpeculation, Speculation
from shared.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger(__name__)

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


def eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
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


class RankBuilder:
    """Builds the ranks of one engine config, in order (rank 0 first)."""

    def __init__(self, cfg: EngineConfig, tokenizer: Any, model_id: str) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_id = model_id
        # the model's facts, read from rank 0's model
        self.kv_layout: KvLayout
        self.max_model_len = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self.vocab_size = 0

    def _device_for(self, dp_rank: int) -> torch.device:
        want = self.cfg.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda":
            if not torch.cuda.is_available():
                raise FailedPrecondition("device cuda requested but CUDA is not available")
            gpus = worker_gpus(self.cfg.cuda_devices, torch.cuda.device_count())
            if dp_rank == len(gpus):  # once, at the first rank that shares a GPU
                # measured on one H200 (README, goodput on a GPU): two ranks of one process on one
                # GPU share a Python thread's launches, and TTFT collapsed under load
                log.warning(
                    "%d DP ranks on %d GPU(s): ranks share a GPU and its launching process; "
                    "prefer one rank per GPU, or more workers",
                    self.cfg.dp_size,
                    len(gpus),
                )
            return torch.device("cuda", rank_gpu(dp_rank, gpus))
        return torch.device(want)

    def build(self, dp_rank: int) -> Rank:
        device = self._device_for(dp_rank)
        # the rank's GPU is the thread's current device while it is built: what uses the
        # current device (torch.cuda.graph's capture stream, a bare synchronize) must mean it
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return self._build(dp_rank, device)

    def _build(self, dp_rank: int, device: torch.device) -> Rank:
        cfg = self.cfg
        dtype = resolve_dtype(cfg.dtype, device)
        backend = ModelBackend.choose(cfg, device)
        cuda = device.type == "cuda"
        allocated_before = torch.cuda.memory_allocated(device) if cuda else 0
        try:
            model = load_model(
                cfg.model_path,
                device,
                dtype,
                prepack=backend.cpu.prepack,
                row_copy=backend.cpu.row_copy,
                quantization=cfg.quantization,
            )
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info(device)
            raise ResourceExhausted(
                f"the model {self.model_id} does not fit on {device}: out of memory while loading it "
                f"in {dtype} ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
            ) from None
        # the adapters attach to the modules they target before any runner reads the model
        lora = LoraSet.load(parse_lora_modules(cfg.lora_modules), model, device, dtype, cfg.enable_lora)
        if lora is not None:
            log.info("rank %d: LoRA adapters: %s", dp_rank, ", ".join(lora.names) or "none yet")
        if dp_rank == 0:
            text_cfg = model.config.get_text_config()
            self.kv_layout = kv_layout_of(model.config, cfg.block_size, dtype, fp8.weights_of(model))
            self.max_model_len = cfg.max_model_len or int(text_cfg.max_position_embeddings)
            self.eos_token_ids = eos_ids(model, self.tokenizer)
            self.vocab_size = int(text_cfg.vocab_size)
        draft_model: Any = None
        draft_layout: KvLayout | None = None
        if cfg.speculative == "draft":
            draft_model = load_draft_model(
                cfg.draft_model_path,
                device,
                dtype,
                backend.cpu.prepack,
                self.vocab_size,
                backend.cpu.row_copy,
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
                backend.without_graphs(),
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
            backend=backend,
            spec_tokens=cfg.num_speculative_tokens if cfg.speculative != "off" else 0,
            max_model_len=self.max_model_len,
            lora=lora,
        )
        runner.warm_up()
        self._prepare_graphs(runner, f"rank {dp_rank}")
        host_cache = None
        if cfg.kv_offload_tokens > 0 and cfg.enable_prefix_caching:
            host_blocks = -(-cfg.kv_offload_tokens // cfg.block_size)
            host_cache = HostKvCache(runner.blocks_view, host_blocks, cfg.block_size)
            log.info(
                "rank %d: host KV tier of %d blocks (%.2f GiB)",
                dp_rank,
                host_cache.num_blocks,
                host_cache.num_blocks * runner.bytes_per_block / 2**30,
            )
        blocks = BlockManager(
            num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            on_evict=host_cache.save if host_cache is not None else None,
        )
        budget = cfg.max_batch_tokens or _DEFAULT_BATCH_TOKENS.get(device.type, 2048)
        scheduler = Scheduler(
            blocks,
            budget,
            cfg.max_num_seqs,
            model_variants.kv_window_tokens(model.config),
            KvTrim.of(model_variants.attention_windows(model.config)),
            eos_token_ids=frozenset(self.eos_token_ids),
            max_model_len=self.max_model_len,
            host_cache=host_cache,
            priority_preemption=cfg.priority_preemption,
        )
        proposer: NgramProposer | DraftProposer | None = None
        if cfg.speculative == "ngram":
            proposer = NgramProposer(cfg.spec_ngram_min, cfg.spec_ngram_max)
        elif draft_model is not None and draft_layout is not None:
            proposer = self._draft_proposer(
                draft_model, draft_layout, num_blocks, device, dtype, budget, backend
            )
        speculation = NoSpeculation()
        if proposer is not None:
            speculation = Speculation(
                proposer,
                cfg.num_speculative_tokens,
                scheduler,
                cfg.spec_max_batch_tokens or _DEFAULT_SPEC_BATCH_TOKENS.get(device.type, 512),
                self.max_model_len,
                self.vocab_size,
                dp_rank,
            )
            if cfg.spec_step_cost:
                prior = calibrate(runner, cfg.num_speculative_tokens)
                log.info("rank %d step cost (calibrated): %s", dp_rank, prior)
                speculation.step_cost = StepCostModel(prior, prior_weight=_STEP_COST_PRIOR_WEIGHT)
        overlap = cfg.async_scheduling if cfg.async_scheduling is not None else device.type == "cuda"
        rank = Rank(
            dp_rank, runner, blocks, scheduler, self.eos_token_ids, speculation, async_scheduling=overlap
        )
        log.info(
            "rank %d ready: %s %s, %d KV blocks of %d tokens",
            dp_rank,
            device,
            dtype,
            num_blocks,
            cfg.block_size,
        )
        return rank

    def _prepare_graphs(self, runner: ModelRunner, what: str) -> None:
        """Capture the runner's CUDA graphs now (decode_graphs.py), not while serving."""
        if runner.graphs is None:
            return
        t0 = time.perf_counter()
        n = runner.graphs.prepare(self.cfg.max_num_seqs, self.cfg.cuda_graph_warm_tokens)
        log.info("%s: %d CUDA graphs captured in %.1f s", what, n, time.perf_counter() - t0)

    def _draft_proposer(
        self,
        model: Any,
        layout: KvLayout,
        target_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_tokens: int,
        backend: ModelBackend,
    ) -> DraftProposer:
        """The draft model's runner and its own KV pool: draft_kv_cache_tokens, else as many
        tokens as the target's pool (every token the target holds, the draft can hold)."""
        cfg = self.cfg
        num_blocks = (
            -(-cfg.draft_kv_cache_tokens // cfg.block_size) if cfg.draft_kv_cache_tokens else target_blocks
        )
        runner = ModelRunner(
            model,
            layout,
            num_blocks,
            device,
            dtype,
            # the target's backend; static steps for its proposal steps (1 row) and catch-up
            # steps (up to k + 1 rows)
            backend=backend,
            spec_tokens=cfg.num_speculative_tokens,
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
