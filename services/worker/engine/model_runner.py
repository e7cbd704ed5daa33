"""One rank's model replica and KV pool: turns a scheduled batch into one packed forward pass
(input_ids [1, T] + position_ids, no padding), then samples the sequences that finished their
prefill or decode this step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.worker.engine import (
    attention,
    cpu_kernels,
    flex_paged,
    model_variants,
    step_inputs,
)
from services.worker.engine.api import KvLayout, SamplingConfig, TokenLogprobs
from services.worker.engine.attention import AttentionBackend
from services.worker.engine.backend import BackendOptions, ModelBackend
from services.worker.engine.decode_graphs import DecodeGraphs, DecodeSeq
from services.worker.engine.draws import PendingSample, draw, sample_step
from services.worker.engine.lean_llama import LeanLlama
from services.worker.engine.lora import LoraSet
from services.worker.engine.pinned import Staging, to_device
from services.worker.engine.sampler import TokenHistory, prompt_logprobs

log = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    """One request's share of a step (a snapshot: the runner never reads Request fields)."""

    token_ids: list[int]  # tokens whose K/V is computed this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's block table, covering start_pos + len(token_ids)
    sample: bool  # the chunk ends at the request's last token: sample the next one
    sampling: SamplingConfig
    generator: torch.Generator | None
    # --- speculative decoding (engine/spec; owned by the request-life side) ---
    # trailing positions whose logits are sampled (1 + proposals verified at the end of token_ids)
    num_logits: int = 1
    # per sampled position: the seed of its draw (Request.draw_seed; None = unseeded)
    draw_seeds: tuple[int | None, ...] = ()
    # the tokens before the first sampled position, for penalties and min_tokens (None: unused);
    # the proposals verified at the end of token_ids extend it for the later positions
    history: TokenHistory | None = None
    # structured output: allowed tokens per sampled position [num_logits, vocab] (bool)
    allowed: torch.Tensor | None = None
    # filled by the runner when sampling.logprobs is set: one entry per sampled position
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # --- prompt logprobs (SamplingConfig.prompt_logprobs; owned by the request-life side) ---
    # the prompt tokens that follow the chunk's positions prompt_offset, prompt_offset + 1, ...
    # (empty: none wanted in this chunk); the runner computes the raw model distribution there
    prompt_targets: tuple[int, ...] = ()
    prompt_offset: int = 0  # index in token_ids of the first position with a prompt target
    # filled by the runner: one entry per prompt_targets token
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        layout: KvLayout,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: AttentionBackend | None = None,
        backend: ModelBackend | None = None,
        spec_tokens: int = 0,
        max_model_len: int = 0,
        lora: LoraSet | None = None,
    ) -> None:
        """backend: the forward path and its options (backend.py); None = the lean forward with
        the CPU attention kernel, on CUDA with FlexAttention where available, no static steps.
        spec_tokens: k of speculative decoding (static verify steps get buckets of k + 1 rows
        per sequence). max_model_len: the longest sequence (tokens), which sizes the static
        steps' block tables (0: the whole pool). lora: the LoRA adapters attached to `model`
        (lora.py; before the lean forward is built, which reads them from the modules)."""
        if backend is None:
            backend = ModelBackend.choose(BackendOptions(cuda_graphs=False), device)
        self.backend = backend
        self.model = model
        self.lora = lora
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.attention_backend = attention_backend or AttentionBackend.default_for(device)
        self._verify_variants = False  # the warm-up step checks every layer's own window
        windows = model_variants.attention_windows(model.config)
        # per layer its attention window; empty when no layer has one (nothing extra per step)
        self.layer_windows: tuple[int | None, ...] = (
            tuple(windows) if any(w is not None for w in windows) else ()
        )
        self.cpu_attention_kernel = (
            backend.cpu.attention_kernel
            and model_variants.attention_softcap(model.config) is None  # the kernel does not cap
            and device.type == "cpu"
            and dtype == torch.float32
            and layout.head_dim % 16 == 0
            and cpu_kernels.available()
        )
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.q_per_kv = int(cfg.num_attention_heads) // layout.num_kv_heads
        # a model the lean loop does not cover runs transformers' forward
        lean = backend.lean and LeanLlama.supports(model)
        use_graphs = backend.cuda.graphs and lean
        self.fused = lean and backend.cuda.kernels and flex_paged.fits_block_size(layout.block_size, device)
        # zeros, not empty: stale rows of reused blocks are never read, but keep them finite.
        # Static decode steps get one more block (index num_blocks, never handed out): their
        # padding sequences write and read it.
        # On CPU on huge pages (cpu_kernels.empty_on_huge_pages): a decode step reads every
        # sequence's blocks, scattered over the pool.
        shape = (
            layout.num_layers,
            2,
            layout.num_kv_heads,
            (num_blocks + int(use_graphs)) * layout.block_size,
            layout.head_dim,
        )
        if device.type == "cpu":
            self.kv_cache = cpu_kernels.empty_on_huge_pages(shape, dtype).zero_()
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        # transformers' module tree, or the same layers as one flat loop (lean_llama)
        self.lean = (
            LeanLlama(model, self.kv_cache, fused=self.fused, compiled=device.type == "cuda")
            if lean
            else None
        )
        # eager steps' index inputs on CUDA: one pinned buffer, grown as needed (step_inputs.py)
        self.input_staging = Staging(4096, torch.long, device)
        # FlexAttention's block tables: as wide as the longest sequence (or the whole pool)
        table_blocks = -(-max_model_len // layout.block_size) if max_model_len > 0 else num_blocks
        self.graphs = (
            DecodeGraphs(
                self.lean,
                self.kv_cache,
                layout.block_size,
                scratch_block=num_blocks,
                dtype=dtype,
                device=device,
                capture=device.type == "cuda",
                spec_tokens=spec_tokens,
                flex_blocks=min(table_blocks, num_blocks) if self.fused else 0,
                layer_windows=self.layer_windows,
            )
            if use_graphs and self.lean is not None
            else None
        )

    @property
    def bytes_per_block(self) -> int:
        lay = self.layout
        return (
            lay.num_layers
            * 2
            * lay.block_size
            * lay.num_kv_heads
            * lay.head_dim
            * self.kv_cache.element_size()
        )

    def _build_metadata(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, attention.PagedAttentionMetadata, torch.Tensor]:
        """The packed step's inputs and attention metadata (step_inputs.py)."""
        return step_inputs.build(self, seqs)

    def bind_thread(self) -> None:
        """Make the runner's GPU the calling thread's current device (a thread starts on GPU 0):
        what uses the current device (a graph captured on first use, a bare synchronize) must
        mean the rank's, on whatever GPU --cuda-devices put it. Nothing elsewhere."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def wait_for_device(self) -> None:
        """Block until every kernel queued so far has run (CUDA; nothing elsewhere). A step that
        samples nothing (non-final prompt chunks) returns with its kernels still queued; what a
        peer reads of the pool outside torch's stream order (a NIXL READ on UCX's own stream, in
        another process) must be written first."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> list[list[int]]:
        """Run one step; for each seq with sample=True, in order, the tokens sampled at its
        num_logits trailing positions (one token without speculation)."""
        graphs = self.graphs
        if (
            graphs is not None
            and seqs
            and all(
                s.sample
                and not s.prompt_targets
                and not s.sampling.lora_adapter  # graphs hold the base model's projections only
                and graphs.fits(len(s.token_ids), s.num_logits)
                for s in seqs
            )
        ):
            # decode steps, verify steps, short prompts: every sequence a few tokens, all sampled
            decoded = graphs.run(
                [DecodeSeq(s.token_ids, s.start_pos, s.block_ids, s.num_logits) for s in seqs]
            )
            return sample_step(decoded, seqs)
        input_ids, positions, meta, logits_idx = self._build_metadata(seqs)
        meta.verify_variants = self._verify_variants
        if len(logits_idx) == 0:
            # nothing to sample (only non-final prefill chunks): skip the LM head entirely
            self._forward(input_ids, positions, meta, None)
            return []
        if any(s.prompt_targets for s in seqs):
            return self._execute_with_prompt_logprobs(seqs, input_ids, positions, meta, logits_idx)
        # --- speculative decoding: logits selection and sampling (request-life side) ---
        sampled_seqs = [s for s in seqs if s.sample]
        counts = [s.num_logits for s in sampled_seqs]
        if any(c != 1 for c in counts):
            # a seq's tokens are packed contiguously: its trailing rows end at its last row
            logits_idx = torch.cat(
                [
                    torch.arange(int(last) - c + 1, int(last) + 1)
                    for last, c in zip(logits_idx.tolist(), counts, strict=True)
                ]
            ).to(logits_idx.device)
        logits = self._forward(input_ids, positions, meta, logits_idx)
        assert logits is not None  # [sum(counts), vocab]
        return sample_step(logits, sampled_seqs)

    @torch.inference_mode()
    def execute_async(self, seqs: list[ScheduledSeq], input_ids: torch.Tensor | None = None) -> PendingSample:
        """A decode step (async scheduling, rank.py) queued on the device: every seq one new
        token, sampled, without logprobs or prompt logprobs. Returns at once with the drawn ids
        on their way to the host (`PendingSample.tokens` waits for them). input_ids: the seqs'
        tokens as a device tensor [len(seqs)] (the previous step's `PendingSample.ids`, whose
        rows are these seqs in order): their token_ids are then placeholders."""
        if not all(
            len(s.token_ids) == 1 and s.sample and not s.prompt_targets and s.sampling.logprobs is None
            for s in seqs
        ):
            raise ValueError("execute_async runs decode steps without logprobs")
        graphs = self.graphs
        if graphs is not None and all(
            graphs.fits(1, s.num_logits) and not s.sampling.lora_adapter for s in seqs
        ):
            logits = graphs.run([DecodeSeq(s.token_ids, s.start_pos, s.block_ids) for s in seqs], input_ids)
        else:
            ids, positions, meta, logits_idx = self._build_metadata(seqs)
            meta.verify_variants = self._verify_variants
            if input_ids is not None:
                # every sequence has one token, so the packed rows are the seqs in order
                ids[0, : len(seqs)].copy_(input_ids)
            out = self._forward(ids, positions, meta, logits_idx)
            assert out is not None
            logits = out
        return PendingSample.start(draw(logits, seqs), seqs)

    def _execute_with_prompt_logprobs(
        self,
        seqs: list[ScheduledSeq],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: attention.PagedAttentionMetadata,
        last_rows: torch.Tensor,
    ) -> list[list[int]]:
        """A step where some prefill chunks want prompt logprobs: the LM head runs at their
        prompt positions too (the rows a chunk's tokens are packed into end at its last row);
        the sampled rows are sampled as usual, the prompt rows get prompt_logprobs."""
        with_rows = [s for s in seqs if s.sample or s.prompt_targets]
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        for s, last in zip(with_rows, last_rows.tolist(), strict=True):
            if s.sample:
                sample_rows.extend(range(last - s.num_logits + 1, last + 1))
            if s.prompt_targets:
                first = last - len(s.token_ids) + 1 + s.prompt_offset
                prompt_rows.extend(range(first, first + len(s.prompt_targets)))
        idx = to_device(sample_rows + prompt_rows, last_rows.device)
        logits = self._forward(input_ids, positions, meta, idx)
        assert logits is not None
        prompt_seqs = [s for s in with_rows if s.prompt_targets]
        lps = prompt_logprobs(
            logits[len(sample_rows) :],
            [t for s in prompt_seqs for t in s.prompt_targets],
            [s.sampling.prompt_logprobs or 0 for s in prompt_seqs for _ in s.prompt_targets],
        )
        pos = 0
        for s in prompt_seqs:
            s.prompt_logprobs = lps[pos : pos + len(s.prompt_targets)]
            pos += len(s.prompt_targets)
        sampled_seqs = [s for s in seqs if s.sample]
        return sample_step(logits[: len(sample_rows)], sampled_seqs) if sampled_seqs else []

    def _forward(
        self,
        input_ids: torch.Tensor,  # [1, T]
        positions: torch.Tensor,  # [1, T]
        meta: attention.PagedAttentionMetadata,
        logits_idx: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The model over the packed step: logits [len(logits_idx), vocab], or None (and no LM
        head) when logits_idx is None."""
        if meta.lora is not None:
            assert self.lora is not None
            with self.lora.running(meta.lora):  # the adapted projections read the step's rows
                return self._forward_model(input_ids, positions, meta, logits_idx)
        return self._forward_model(input_ids, positions, meta, logits_idx)

    def _forward_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: attention.PagedAttentionMetadata,
        logits_idx: torch.Tensor | None,
    ) -> torch.Tensor | None:
        if self.lean is not None:
            return self.lean.forward(input_ids[0], positions[0], meta, logits_idx)
        if logits_idx is None:
            self.model.model(input_ids=input_ids, position_ids=positions, paged_meta=meta, use_cache=False)
            return None
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            paged_meta=meta,
            use_cache=False,
            logits_to_keep=logits_idx,
        )
        return out.logits[0]

    def warm_up(self) -> None:
        """One tiny forward (writes block 0, which holds no request yet); it also checks every
        layer's own attention call against the windows read from the config."""
        t0 = time.perf_counter()
        seq = ScheduledSeq(
            token_ids=[0] * min(4, self.layout.block_size),
            start_pos=0,
            block_ids=[0],
            sample=True,
            sampling=SamplingConfig(max_tokens=1, temperature=0.0),
            generator=None,
        )
        self._verify_variants = True
        try:
            self.execute([seq])
        finally:
            self._verify_variants = False
        log.debug("warm-up step took %.3f s", time.perf_counter() - t0)

    # ---- KV transfer ---------------------------------------------------------------------
    def blocks_view(self) -> torch.Tensor:
        """The KV pool by block, [layers, 2, kv_heads, blocks, block_size, head_dim] (a view)."""
        return self._by_block()

    def _by_block(self) -> torch.Tensor:
        lay = self.layout
        # every block of the pool (the scratch block of static decode steps too)
        return self.kv_cache.view(lay.num_layers, 2, lay.num_kv_heads, -1, lay.block_size, lay.head_dim)

    def read_blocks(self, block_ids: list[int], layers: tuple[int, ...] | None = None) -> bytes:
        """Blocks in the wire layout: per block, per layer (of `layers`; None: all), K then V
        [kv_heads, block_size, D]. On CUDA the blocks come back through pinned memory (one DMA,
        not the driver's staging of a pageable copy)."""
        idx = to_device(block_ids, self.device)
        pool = self._by_block()
        if layers is not None:
            pool = pool.index_select(0, to_device(list(layers), self.device))
        data = pool.index_select(3, idx)  # [L, 2, H, n, bs, D]
        data = data.permute(3, 0, 1, 2, 4, 5).contiguous()  # [n, L, 2, H, bs, D]
        if self.device.type == "cuda":
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            self.wait_for_device()  # before the host reads it
            data = host
        return data.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes, layers: tuple[int, ...] | None = None) -> None:
        """The inverse of read_blocks: only `layers` (None: all) of the blocks are written."""
        lay = self.layout
        n = len(block_ids)
        num_layers = lay.num_layers if layers is None else len(layers)
        if self.device.type == "cuda":
            # the bytes once into pinned memory, one DMA of them, the permute on the device
            # (torch's host allocator keeps the pinned block until the copy is done)
            host = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
            host.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            raw = host.to(self.device, non_blocking=True)
        else:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        arr = raw.view(self.dtype).view(n, num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)
        arr = arr.permute(1, 2, 3, 0, 4, 5)  # [L, 2, H, n, bs, D]
        idx = to_device(block_ids, self.device)
        pool = self._by_block()
        if layers is None:
            pool.index_copy_(3, idx, arr)
            return
        for j, layer in enumerate(layers):
            pool[layer].index_copy_(2, idx, arr[j])
