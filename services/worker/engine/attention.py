"""Attention over the paged KV pool, plugged into transformers' own model classes.

`register()` adds the "pdserve_paged" implementation to transformers' AttentionInterface; models
loaded with attn_implementation="pdserve_paged" call `paged_attention_forward` in every layer with
our per-step `paged_meta` (forward kwargs flow down to the attention function).

The BATCHED backend's groups are built and attended in attention_batched.py; the one attention
call both backends make (SDPA, or soft-capped op for op) is sdpa.py.

Pool layout (one tensor per rank): [num_layers, 2 (K, V), num_kv_heads, num_blocks * block_size,
head_dim], i.e. per layer and head a flat array of token slots (slot = block * block_size + row).
Each step first writes the packed tokens' K/V to their slots (one index_copy_ per layer), then
attends in one of two ways, chosen per step by the runner (`AttentionBackend`):

- BATCHED: one SDPA call per layer for a whole group of sequences with any query lengths
  (decode, speculative verify passes of k+1 tokens, prefill chunks on cached context, fresh
  prefills). Keys/values come from the pool by block table (one index_select of whole blocks
  per layer into a padded [B, kv_heads, max_blocks * block_size, D] view), queries are padded
  to the group's longest, and a per-step additive mask (built once, shared by all layers) hides
  padding and future positions. The `rep` query heads that share a KV head are folded into
  query rows, so there is no GQA expansion. Dispatch per layer is constant in the batch size:
  the default on CUDA, where per-call overhead dominates.
- PER_SEQ: one SDPA call per sequence over a zero-copy strided view of its slots when its
  blocks are consecutive (the block manager allocates consecutive runs when it can; otherwise
  its blocks are gathered). Measured on the 2-core CPUs this project benchmarks on (8 decoding
  sequences of 96-544 tokens, fp32, one thread): 0.50 ms per layer against 1.35 ms for the
  batched call, whose block gather and padded SDPA cost more than 8 calls that each stream
  their sequence's K/V once near memory bandwidth. The default on CPU.

Attention variants (engine/model_variants.py reads them from the model's config):
- Sliding windows: a layer with window W lets the query at position p see keys p - W + 1 .. p
  (transformers' `kv_idx > q_idx - sliding_window`). The metadata carries every layer's window
  (`layer_windows`) and, per window the step's sequences reach, a variant of itself whose masks,
  first keys (`SeqAttention.first_key`) and kernel spans (`decode_starts`) honour it
  (`windowed`); each layer attends with `for_layer(layer)`. Non-windowed models build nothing
  extra.
- Logit soft-capping (`softcap`, passed by Gemma-style models): scores -> cap * tanh(s / cap)
  before the mask, computed op for op as transformers' eager attention does (SDPA has no
  soft-cap), never by the CPU decode kernel.
- Attention sinks (`s_aux`) are refused (model_variants.check_supported refuses such models at
  start; this is the last line of defence).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from services.worker.engine import cpu_kernels, model_variants
from services.worker.engine.attention_batched import BatchedGroup, batched_attention, group_attention
from services.worker.engine.sdpa import attend

if TYPE_CHECKING:
    from services.worker.engine.flex_paged import FlexPagedStep
    from services.worker.engine.lora import LoraStep

ATTN_IMPLEMENTATION = "pdserve_paged"


class AttentionBackend(enum.Enum):
    BATCHED = "batched"
    PER_SEQ = "per_seq"

    @staticmethod
    def default_for(device: torch.device) -> AttentionBackend:
        return AttentionBackend.BATCHED if device.type == "cuda" else AttentionBackend.PER_SEQ


@dataclass
class SeqAttention:
    """One sequence's share of a packed step (PER_SEQ backend)."""

    q_start: int  # first packed position of its new tokens
    q_len: int  # new tokens this step
    ctx_len: int  # tokens attended to = cached before the step + q_len
    fresh: bool  # nothing cached before: attend causally over the step's own K/V
    # where its cached K/V is; both None for a single-token sequence that decode_spans serve
    kv_start: int | None  # first slot when its blocks are consecutive (zero-copy view)
    blocks: torch.Tensor | None  # its block ids when they are not consecutive (gathered)
    # [q_len, ctx_len - first_key] bool for a later chunk of q_len > 1 or a fresh prefill longer
    # than the layer's window, else None (a lone query, or causal over the step's own K/V)
    mask: torch.Tensor | None
    first_key: int = 0  # keys before it are behind the layer's window: never read


@dataclass
class PagedAttentionMetadata:
    kv_cache: torch.Tensor  # the rank's pool, layout above
    block_size: int
    slots: torch.Tensor  # [T] slot of each packed token
    seqs: list[SeqAttention]  # PER_SEQ: in packed order
    decode_idx: torch.Tensor | None  # PER_SEQ: [B] packed positions of single-token sequences
    num_decode: int  # PER_SEQ: how many of `seqs` have q_len 1 (B)
    groups: list[BatchedGroup] | None = None  # BATCHED: the calls of each layer
    # PER_SEQ on CPU: (block tables [B, max blocks], context lengths [B]) of the num_decode
    # sequences, int64, when engine/cpu_kernels.py's decode attention serves them (one call per
    # layer, blocks read in place); None: one SDPA call per sequence
    decode_spans: tuple[torch.Tensor, torch.Tensor] | None = None
    # CUDA static steps (decode_graphs.py with FlexAttention): every sequence's rows attend to the
    # pool in place through this step's block tables (flex_paged.py); the lean forward's fused
    # layers use it instead of `groups`
    flex: FlexPagedStep | None = None
    # BATCHED on CUDA with FlexAttention, a mixed step (prompt chunks and decode rows): the first
    # n packed rows (the decode rows, one query each) attend to the pool in place through this
    # FlexPagedStep (a decode bucket's, filled with their block tables), the groups serve the
    # rest; no gather of the decode rows' KV, no padded SDPA over it. (step, n)
    flex_short: tuple[FlexPagedStep, int] | None = None
    # with decode_spans: [B] int64 first key each decode sequence sees (its layer's window);
    # None: every sequence from its first token
    decode_starts: torch.Tensor | None = None
    # per layer, its attention window (model_variants.attention_windows); empty: all full
    layer_windows: Sequence[int | None] = ()
    # for every window in layer_windows: this step's metadata for the layers with that window
    # (same pool and slots; masks, first keys and spans honouring the window), or this metadata
    # itself when no sequence of the step reaches past the window
    windowed: dict[int, PagedAttentionMetadata] = field(default_factory=dict)
    # check each layer's own attention call against layer_windows (the runner's warm-up step)
    verify_variants: bool = False
    # the step's rows served by LoRA adapters (lora.py); None: every row is the base model's
    lora: LoraStep | None = None

    def for_layer(self, layer: int) -> PagedAttentionMetadata:
        """The metadata layer `layer` attends with."""
        if not self.layer_windows:
            return self
        window = self.layer_windows[layer]
        return self if window is None else self.windowed[window]


def _context(pool: torch.Tensor, s: SeqAttention, block_size: int) -> torch.Tensor:
    """[1, kv_heads, ctx_len - first_key, head_dim] of one sequence (a view when its blocks are
    consecutive, else gathered)."""
    if s.kv_start is not None:
        return pool[:, :, s.kv_start + s.first_key : s.kv_start + s.ctx_len]
    assert s.blocks is not None
    _, heads, _, dim = pool.shape
    by_block = pool.view(heads, -1, block_size, dim)
    return by_block.index_select(1, s.blocks).view(1, heads, -1, dim)[:, :, s.first_key : s.ctx_len]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_meta: PagedAttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if paged_meta is None:
        raise RuntimeError("pdserve_paged attention needs paged_meta (use the engine)")
    if kwargs.get("s_aux") is not None:
        raise RuntimeError("pdserve_paged attention does not compute attention sinks (s_aux)")
    softcap: float | None = kwargs.get("softcap")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    if paged_meta.verify_variants:
        _verify_window(layer, paged_meta, kwargs)
    meta = paged_meta.for_layer(layer)
    layer_kv = meta.kv_cache[layer]  # [2, kv_heads, slots, head_dim]
    layer_kv[0].index_copy_(1, meta.slots, key[0])
    layer_kv[1].index_copy_(1, meta.slots, value[0])
    if meta.groups is not None:
        out = batched_attention(query, layer_kv, meta.block_size, meta.groups, scaling, softcap, key, value)
        return out, None
    return _per_seq(query, key, value, layer_kv, meta, scaling, softcap), None


def _verify_window(layer: int, meta: PagedAttentionMetadata, kwargs: dict[str, Any]) -> None:
    """The window the model's own attention call passes (transformers' modules pass their
    layer's `sliding_window`) is the one model_variants read from the config: a family whose
    config the engine reads differently is refused at warm-up, never served."""
    if "sliding_window" not in kwargs:
        return
    expected = meta.layer_windows[layer] if meta.layer_windows else None
    if kwargs["sliding_window"] != expected:
        raise model_variants.UnsupportedAttention(
            f"layer {layer} attends with sliding_window={kwargs['sliding_window']!r}, but the engine "
            f"read {expected!r} from the model config: this family's windows are not supported"
        )


# ---- PER_SEQ ---------------------------------------------------------------------------------
def _per_seq(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_kv: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    bs = meta.block_size
    k_pool = layer_kv[0:1]  # [1, kv_heads, slots, head_dim]
    v_pool = layer_kv[1:2]
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rep = num_heads // num_kv_heads
    if meta.num_decode == num_tokens:  # decode-only step: no scatter needed
        out_d = _decode(query, k_pool, v_pool, meta, scaling, num_kv_heads, rep, softcap)
        return out_d.view(1, num_tokens, num_heads, head_dim)

    out = query.new_empty(num_tokens, num_heads, head_dim)
    if meta.num_decode:
        assert meta.decode_idx is not None
        out[meta.decode_idx] = _decode(query, k_pool, v_pool, meta, scaling, num_kv_heads, rep, softcap)
    for s in meta.seqs[meta.num_decode :]:
        q = query[:, :, s.q_start : s.q_start + s.q_len]  # [1, heads, q_len, D]
        if s.fresh:
            k = key[:, :, s.q_start : s.q_start + s.q_len]
            v = value[:, :, s.q_start : s.q_start + s.q_len]
            # causal over its own K/V, or masked where it reaches past the layer's window
            o = attend(q, k, v, scaling, softcap, mask=s.mask, is_causal=s.mask is None)
        else:
            k = _context(k_pool, s, bs)
            v = _context(v_pool, s, bs)
            o = attend(q, k, v, scaling, softcap, mask=s.mask)
        out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


def _decode(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None,
    num_kv_heads: int,
    rep: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """Single-query sequences -> [B, heads, head_dim]. The `rep` query heads sharing a KV head
    become `rep` query rows, so there is no GQA expansion and no mask (a lone query attends to
    every cached token from its first_key on)."""
    head_dim = query.shape[-1]
    if meta.num_decode == query.shape[2]:
        qd = query[0].transpose(0, 1)  # [B, heads, D]
    else:
        assert meta.decode_idx is not None
        qd = query[0].index_select(1, meta.decode_idx).transpose(0, 1)
    qd = qd.reshape(-1, num_kv_heads, rep, head_dim)  # [B, kv_heads, rep, D]
    out = decode_attention(
        qd,
        k_pool,
        v_pool,
        meta.seqs[: meta.num_decode],
        meta.block_size,
        scaling,
        meta.decode_spans,
        meta.decode_starts,
        softcap,
    )
    return out.view(-1, num_kv_heads * rep, head_dim)


def decode_attention(
    queries: torch.Tensor,  # [B, kv_heads, rep, D]: each sequence's one query token
    k_pool: torch.Tensor,  # [1, kv_heads, slots, D] of one layer
    v_pool: torch.Tensor,
    seqs: Sequence[SeqAttention],  # the same sequences, in the same order
    block_size: int,
    scaling: float | None,
    spans: tuple[torch.Tensor, torch.Tensor] | None = None,  # PagedAttentionMetadata.decode_spans
    starts: torch.Tensor | None = None,  # PagedAttentionMetadata.decode_starts
    softcap: float | None = None,
) -> torch.Tensor:
    """One SDPA call per single-query sequence over its slots from its first_key on (a view when
    its blocks are consecutive, else gathered), or with `spans` one call of the CPU kernel for
    them all; -> [B * kv_heads, rep, D] (= [B, heads, D] in memory). Shared by the PER_SEQ
    backend and the lean forward's decode steps (lean_llama)."""
    if spans is not None:
        if softcap is not None:  # the runner never builds spans for a soft-capped model
            raise RuntimeError("the CPU decode-attention kernel does not soft-cap")
        head_dim = k_pool.shape[-1]
        scale = scaling if scaling is not None else head_dim**-0.5
        return cpu_kernels.decode_attention(
            queries, k_pool[0], v_pool[0], spans[0], spans[1], block_size, scale, starts=starts
        )
    outs = []
    # one unbind, not a select per sequence: [1, kv_heads, rep, D] each
    for q, s in zip(queries.unsqueeze(1).unbind(0), seqs, strict=True):
        if s.kv_start is not None:
            k = k_pool[:, :, s.kv_start + s.first_key : s.kv_start + s.ctx_len]
            v = v_pool[:, :, s.kv_start + s.first_key : s.kv_start + s.ctx_len]
        else:
            k = _context(k_pool, s, block_size)
            v = _context(v_pool, s, block_size)
        outs.append(attend(q, k, v, scaling, softcap))
    return torch.cat(outs)


# the BATCHED backend's per-group call, under its former name (benchmarks/cuda_attention.py)
_group_attention = group_attention

_registered = False


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    _registered = True
