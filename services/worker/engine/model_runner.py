"""One rank's model replica and KV pool: turns a scheduled batch into one packed forward pass
(input_ids [1, T] + position_ids, no padding), then samples the sequences that finished their
prefill or decode this step."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.worker.engine import attention, cpu_kernels, cpu_linear, flex_paged, model_variants
from services.worker.engine.api import KvLayout, SamplingConfig, TokenLogprobs
from services.worker.engine.attention import AttentionBackend
from services.worker.engine.decode_graphs import DecodeGraphs, DecodeSeq
from services.worker.engine.lean_llama import LeanLlama
from services.worker.engine.sampler import (
    TokenHistory,
    apply_allowed,
    prompt_logprobs,
    sample,
    sample_with_logprobs,
)
from shared.model_store import load_causal_lm

log = logging.getLogger(__name__)

# BATCHED backend: sequences with at most this many new tokens (decode, speculative verify,
# short chunks) share one padded call; longer prefill chunks share a second one, so a decode
# row is never padded to a prefill chunk's length.
_SHORT_QUERY = 32

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPES[name]


def load_model(
    model_path: str, device: torch.device, dtype: torch.dtype, prepack: bool = True, row_copy: bool = False
) -> Any:
    """transformers' own model class with our attention; on CPU its linear layers prepacked
    for oneDNN unless `prepack` is False, with `row_copy` also as a copy for steps of few rows
    (see cpu_linear). Raises model_variants.UnsupportedAttention (before loading weights) for
    a model whose attention the engine cannot reproduce exactly."""
    from transformers import AutoConfig

    model_variants.check_supported(AutoConfig.from_pretrained(model_path))
    attention.register()
    # a folder's weights, or a random-weight model built on the device (`random:` models)
    model = load_causal_lm(model_path, device, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION)
    model_variants.check_loaded(model)
    model.eval()
    # serving never differentiates: no autograd state in the weights (torch.compile'd layers
    # would otherwise trace for training)
    model.requires_grad_(False)
    if prepack:
        cpu_linear.prepack_linears(model, row_copy)
    return model


def kv_layout_of(model_config: Any, block_size: int, dtype: torch.dtype) -> KvLayout:
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return KvLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
    )


class ModelRunner:
    def __init__(
        self,
        model: Any,
        layout: KvLayout,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: AttentionBackend | None = None,
        lean_forward: bool = True,
        decode_graphs: bool = False,
        spec_tokens: int = 0,
        cpu_attention_kernel: bool = True,
        cuda_kernels: bool = True,
        max_model_len: int = 0,
        fused: bool | None = None,
    ) -> None:
        """decode_graphs: decode and verify steps run as static-shape steps
        (engine/decode_graphs.py), captured as CUDA graphs on CUDA and run eagerly elsewhere
        (tests); needs the lean forward, ignored without it. spec_tokens: k of speculative
        decoding (its verify steps get buckets of k + 1 rows per sequence).
        cpu_attention_kernel: on CPU in fp32, decode attention of every single-token sequence
        of a layer in one call of engine/cpu_kernels.py's kernel (where it is built) instead of
        one SDPA call per sequence.
        cuda_kernels: on CUDA, the lean forward's fused layers (lean_llama.py, torch.compile)
        and static steps whose attention reads the pool in place (flex_paged.py) where
        FlexAttention is available; False: the torch-only eager path. `fused` overrides the choice
        (tests: True runs the same path eagerly on CPU). max_model_len: the longest sequence
        (tokens), which sizes the static steps' block tables (0: the whole pool)."""
        self.model = model
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
            cpu_attention_kernel
            and model_variants.attention_softcap(model.config) is None  # the kernel does not cap
            and device.type == "cpu"
            and dtype == torch.float32
            and layout.head_dim % 16 == 0
            and cpu_kernels.available()
        )
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.q_per_kv = int(cfg.num_attention_heads) // layout.num_kv_heads
        lean = lean_forward and LeanLlama.supports(model)
        use_graphs = decode_graphs and lean
        if fused is None:
            fused = device.type == "cuda" and cuda_kernels and flex_paged.available()
        self.fused = lean and fused
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
        if self.attention_backend is AttentionBackend.BATCHED:
            return self._build_batched_metadata(seqs)
        bs = self.layout.block_size
        dev = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        attn: list[attention.SeqAttention] = []
        # single-token sequences first: attention batches their bookkeeping
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []  # block ids of each single-token sequence
        for i in order:
            s = seqs[i]
            q_start = len(input_ids)
            n = len(s.token_ids)
            ctx = s.start_pos + n
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, ctx)
            positions.extend(pos)
            blocks = s.block_ids[: -(-ctx // bs)]
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            fresh = s.start_pos == 0
            kv_start: int | None = None
            block_tensor: torch.Tensor | None = None
            if n == 1:
                decode_idx.append(q_start)
                decode_tables.append(blocks)
            if not fresh or n == 1:
                if blocks[-1] - blocks[0] == len(blocks) - 1 and _consecutive(blocks):
                    kv_start = blocks[0] * bs
                else:
                    block_tensor = torch.tensor(blocks, device=dev)
            attn.append(_seq_attention(q_start, n, s.start_pos, kv_start, block_tensor, None, dev))
        # logits rows in the caller's order of the sampling sequences
        first_pos = {i: a.q_start + a.q_len - 1 for i, a in zip(order, attn, strict=True)}
        logits_idx = [first_pos[i] for i, s in enumerate(seqs) if s.sample or s.prompt_targets]
        spans = None
        if self.cpu_attention_kernel and decode_idx:
            # the decode sequences' block tables (padded with 0) and context lengths
            width = max(len(t) for t in decode_tables)
            spans = (
                torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int64),
                torch.tensor([a.ctx_len for a in attn[: len(decode_idx)]], dtype=torch.int64),
            )
        meta = attention.PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            block_size=bs,
            slots=torch.tensor(slots, device=dev),
            seqs=attn,
            decode_idx=torch.tensor(decode_idx, device=dev) if decode_idx else None,
            num_decode=len(decode_idx),
            decode_spans=spans,
            layer_windows=self.layer_windows,
        )
        max_ctx = max(a.ctx_len for a in attn) if self.layer_windows else 0
        for window in sorted({w for w in self.layer_windows if w is not None}):
            if max_ctx <= window:  # no query of the step reaches past the window
                meta.windowed[window] = meta
                continue
            w_attn = [
                _seq_attention(a.q_start, a.q_len, a.ctx_len - a.q_len, a.kv_start, a.blocks, window, dev)
                for a in attn
            ]
            starts = None
            if spans is not None:
                starts = torch.tensor([a.first_key for a in w_attn[: len(decode_idx)]], dtype=torch.int64)
            meta.windowed[window] = dataclasses.replace(meta, seqs=w_attn, decode_starts=starts, windowed={})
        return (
            torch.tensor([input_ids], device=dev),
            torch.tensor([positions], device=dev),
            meta,
            torch.tensor(logits_idx, device=dev),
        )

    def _build_batched_metadata(
        self, seqs: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, attention.PagedAttentionMetadata, torch.Tensor]:
        bs = self.layout.block_size
        dev = self.device
        # short queries first, then long chunks; each part is one attention call per layer
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) > _SHORT_QUERY)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        parts: tuple[list[tuple[int, int, int, list[int]]], ...] = ([], [])
        last_pos: dict[int, int] = {}
        for i in order:
            s = seqs[i]
            q_start = len(input_ids)
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            parts[n > _SHORT_QUERY].append((q_start, n, s.start_pos, blocks))
            last_pos[i] = q_start + n - 1
        nonempty = [p for p in parts if p]

        def groups_for(window: int | None) -> list[attention.BatchedGroup]:
            return [
                attention.build_batched_group(
                    p, bs, self.q_per_kv, self.dtype, dev, covers_all=len(nonempty) == 1, window=window
                )
                for p in nonempty
            ]

        logits_idx = [last_pos[i] for i, s in enumerate(seqs) if s.sample or s.prompt_targets]
        meta = attention.PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            block_size=bs,
            slots=torch.tensor(slots, device=dev),
            seqs=[],
            decode_idx=None,
            num_decode=0,
            groups=groups_for(None),
            layer_windows=self.layer_windows,
        )
        max_ctx = max(s.start_pos + len(s.token_ids) for s in seqs) if self.layer_windows else 0
        for window in sorted({w for w in self.layer_windows if w is not None}):
            meta.windowed[window] = (
                meta
                if max_ctx <= window
                else dataclasses.replace(meta, groups=groups_for(window), windowed={})
            )
        return (
            torch.tensor([input_ids], device=dev),
            torch.tensor([positions], device=dev),
            meta,
            torch.tensor(logits_idx, device=dev),
        )

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> list[list[int]]:
        """Run one step; for each seq with sample=True, in order, the tokens sampled at its
        num_logits trailing positions (one token without speculation)."""
        graphs = self.graphs
        if (
            graphs is not None
            and seqs
            and all(
                s.sample and not s.prompt_targets and graphs.fits(len(s.token_ids), s.num_logits)
                for s in seqs
            )
        ):
            # decode steps, verify steps, short prompts: every sequence a few tokens, all sampled
            decoded = graphs.run(
                [DecodeSeq(s.token_ids, s.start_pos, s.block_ids, s.num_logits) for s in seqs]
            )
            return _sample(decoded, seqs)
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
        return _sample(logits, sampled_seqs)

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
        idx = torch.tensor(sample_rows + prompt_rows, device=last_rows.device)
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
        return _sample(logits[: len(sample_rows)], sampled_seqs) if sampled_seqs else []

    def _forward(
        self,
        input_ids: torch.Tensor,  # [1, T]
        positions: torch.Tensor,  # [1, T]
        meta: attention.PagedAttentionMetadata,
        logits_idx: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The model over the packed step: logits [len(logits_idx), vocab], or None (and no LM
        head) when logits_idx is None."""
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
    def _by_block(self) -> torch.Tensor:
        lay = self.layout
        # every block of the pool (the scratch block of static decode steps too)
        return self.kv_cache.view(lay.num_layers, 2, lay.num_kv_heads, -1, lay.block_size, lay.head_dim)

    def read_blocks(self, block_ids: list[int], layers: tuple[int, ...] | None = None) -> bytes:
        """Blocks in the wire layout: per block, per layer (of `layers`; None: all), K then V
        [kv_heads, block_size, D]."""
        idx = torch.tensor(block_ids, device=self.device)
        pool = self._by_block()
        if layers is not None:
            pool = pool.index_select(0, torch.tensor(layers, device=self.device))
        data = pool.index_select(3, idx)  # [L, 2, H, n, bs, D]
        data = data.permute(3, 0, 1, 2, 4, 5).contiguous().cpu()  # [n, L, 2, H, bs, D]
        return data.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes, layers: tuple[int, ...] | None = None) -> None:
        """The inverse of read_blocks: only `layers` (None: all) of the blocks are written."""
        lay = self.layout
        n = len(block_ids)
        num_layers = lay.num_layers if layers is None else len(layers)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        arr = raw.view(self.dtype).view(n, num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)
        arr = arr.permute(1, 2, 3, 0, 4, 5).to(self.device)  # [L, 2, H, n, bs, D]
        idx = torch.tensor(block_ids, device=self.device)
        pool = self._by_block()
        if layers is None:
            pool.index_copy_(3, idx, arr)
            return
        for j, layer in enumerate(layers):
            pool[layer].index_copy_(2, idx, arr[j])


def _sample(logits: torch.Tensor, sampled_seqs: list[ScheduledSeq]) -> list[list[int]]:
    """logits [sum of num_logits, vocab], each sequence's rows in order -> its drawn tokens."""
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
    if any(p.logprobs is not None for p in params):
        drawn, logprobs = sample_with_logprobs(logits, params, gens, seeds, histories)
    else:
        drawn, logprobs = sample(logits, params, gens, seeds, histories), []
    flat = [int(t) for t in drawn.tolist()]
    tokens: list[list[int]] = []
    pos = 0
    for s in sampled_seqs:
        tokens.append(flat[pos : pos + s.num_logits])
        if logprobs:
            s.logprobs = [lp for lp in logprobs[pos : pos + s.num_logits] if lp is not None]
        pos += s.num_logits
    return tokens


def _seq_attention(
    q_start: int,
    n: int,
    start_pos: int,
    kv_start: int | None,
    blocks: torch.Tensor | None,
    window: int | None,
    dev: torch.device,
) -> attention.SeqAttention:
    """One sequence's PER_SEQ attention for layers with `window` (None: full): query i (position
    start_pos + i) sees keys max(0, start_pos + i - window + 1) .. start_pos + i; keys before
    the first query's first visible one are not read at all (first_key)."""
    ctx = start_pos + n
    fresh = start_pos == 0 and n > 1
    first_key = 0 if window is None else max(0, start_pos - window + 1)
    mask: torch.Tensor | None = None
    if n > 1 and (not fresh or (window is not None and ctx > window)):
        q_pos = torch.arange(start_pos, ctx, device=dev)[:, None]
        k_pos = torch.arange(first_key, ctx, device=dev)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    return attention.SeqAttention(q_start, n, ctx, fresh, kv_start, blocks, mask, first_key)


def _consecutive(blocks: list[int]) -> bool:
    first = blocks[0]
    return all(b == first + i for i, b in enumerate(blocks))
