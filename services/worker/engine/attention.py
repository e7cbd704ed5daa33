"""Attention over the paged KV pool, plugged into transformers' own model classes.

`register()` adds the "pdserve_paged" implementation to transformers' AttentionInterface; models
loaded with attn_implementation="pdserve_paged" call `paged_attention_forward` in every layer with
our per-step `paged_meta` (forward kwargs flow down to the attention function).

Pool layout (one tensor per rank): [num_layers, 2 (K, V), num_kv_heads, num_blocks * block_size,
head_dim], i.e. per layer and head a flat array of token slots (slot = block * block_size + row).
A request whose blocks are consecutive therefore has its K/V as a zero-copy strided view
[kv_heads, ctx, head_dim]; the block manager allocates consecutive runs when it can, and other
requests gather their blocks (one index_select per layer). Each step the packed tokens' K/V are
written to their slots, then one SDPA call per sequence runs over its view: on this CPU that is
~5x cheaper than gathering every sequence into a padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class SeqAttention:
    """One sequence's share of a packed step."""

    q_start: int  # first packed position of its new tokens
    q_len: int  # new tokens this step
    ctx_len: int  # tokens attended to = cached before the step + q_len
    fresh: bool  # nothing cached before: attend causally over the step's own K/V
    kv_start: int | None  # first slot when its blocks are consecutive (zero-copy view)
    blocks: torch.Tensor | None  # its block ids when they are not consecutive (gathered)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool for a later prefill chunk, else None


@dataclass
class PagedAttentionMetadata:
    kv_cache: torch.Tensor  # the rank's pool, layout above
    block_size: int
    slots: torch.Tensor  # [T] slot of each packed token
    seqs: list[SeqAttention]  # in packed order
    decode_idx: torch.Tensor | None  # [B] packed positions of the single-token sequences
    num_decode: int  # how many of `seqs` have q_len 1 (B)


def _context(pool: torch.Tensor, s: SeqAttention, block_size: int) -> torch.Tensor:
    """[1, kv_heads, ctx_len, head_dim] of one sequence (a view when its blocks are
    consecutive, else gathered)."""
    if s.kv_start is not None:
        return pool[:, :, s.kv_start : s.kv_start + s.ctx_len]
    assert s.blocks is not None
    _, heads, _, dim = pool.shape
    by_block = pool.view(heads, -1, block_size, dim)
    return by_block.index_select(1, s.blocks).view(1, heads, -1, dim)[:, :, : s.ctx_len]


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
    meta = paged_meta
    bs = meta.block_size
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_pool = meta.kv_cache[layer, 0:1]  # [1, kv_heads, slots, head_dim]
    v_pool = meta.kv_cache[layer, 1:2]
    k_pool[0].index_copy_(1, meta.slots, key[0])
    v_pool[0].index_copy_(1, meta.slots, value[0])

    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rep = num_heads // num_kv_heads
    if meta.num_decode == num_tokens:  # decode-only step: no scatter needed
        out_d = _decode(query, k_pool, v_pool, meta, scaling, num_kv_heads, rep)
        return out_d.view(1, num_tokens, num_heads, head_dim), None

    out = query.new_empty(num_tokens, num_heads, head_dim)
    if meta.num_decode:
        assert meta.decode_idx is not None
        out[meta.decode_idx] = _decode(query, k_pool, v_pool, meta, scaling, num_kv_heads, rep)
    for s in meta.seqs[meta.num_decode :]:
        q = query[:, :, s.q_start : s.q_start + s.q_len]  # [1, heads, q_len, D]
        if s.fresh:
            k = key[:, :, s.q_start : s.q_start + s.q_len]
            v = value[:, :, s.q_start : s.q_start + s.q_len]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                               enable_gqa=rep > 1)
        else:
            k = _context(k_pool, s, bs)
            v = _context(v_pool, s, bs)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, scale=scaling,
                                               enable_gqa=rep > 1)
        out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            meta: PagedAttentionMetadata, scaling: float | None, num_kv_heads: int,
            rep: int) -> torch.Tensor:
    """Single-query sequences -> [B, heads, head_dim]. The `rep` query heads sharing a KV head
    become `rep` query rows, so there is no GQA expansion and no mask (a lone query attends to
    every cached token)."""
    head_dim = query.shape[-1]
    if meta.num_decode == query.shape[2]:
        qd = query[0].transpose(0, 1)  # [B, heads, D]
    else:
        assert meta.decode_idx is not None
        qd = query[0].index_select(1, meta.decode_idx).transpose(0, 1)
    qd = qd.reshape(-1, 1, num_kv_heads, rep, head_dim)  # [B, 1, kv_heads, rep, D]
    bs = meta.block_size
    outs = []
    for i, s in enumerate(meta.seqs[: meta.num_decode]):
        if s.kv_start is not None:
            k = k_pool[:, :, s.kv_start : s.kv_start + s.ctx_len]
            v = v_pool[:, :, s.kv_start : s.kv_start + s.ctx_len]
        else:
            k = _context(k_pool, s, bs)
            v = _context(v_pool, s, bs)
        outs.append(F.scaled_dot_product_attention(qd[i], k, v, scale=scaling))
    return torch.cat(outs).view(-1, num_kv_heads * rep, head_dim)


_registered = False


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    _registered = True
