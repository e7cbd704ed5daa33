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
    seqs: list[SeqAttention]


def _context(pool: torch.Tensor, s: SeqAttention, block_size: int) -> torch.Tensor:
    """[kv_heads, ctx_len, head_dim] of one sequence (a view when its blocks are consecutive)."""
    if s.kv_start is not None:
        return pool[:, s.kv_start : s.kv_start + s.ctx_len]
    assert s.blocks is not None
    heads, _, dim = pool.shape
    by_block = pool.view(heads, -1, block_size, dim)
    return by_block.index_select(1, s.blocks).view(heads, -1, dim)[:, : s.ctx_len]


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
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_pool = meta.kv_cache[layer, 0]  # [kv_heads, slots, head_dim]
    v_pool = meta.kv_cache[layer, 1]
    k_pool.index_copy_(1, meta.slots, key[0])
    v_pool.index_copy_(1, meta.slots, value[0])

    q_all = query[0]  # [heads, T, head_dim]
    num_heads, _, head_dim = q_all.shape
    num_kv_heads = key.shape[1]
    rep = num_heads // num_kv_heads
    outs: list[torch.Tensor] = []
    for s in meta.seqs:
        q = q_all[:, s.q_start : s.q_start + s.q_len]  # [heads, q_len, D]
        if s.q_len == 1:
            # decode: the `rep` query heads sharing a KV head become rep query rows, so no GQA
            # expansion and no mask (a single query attends to every cached token)
            k = _context(k_pool, s, meta.block_size)
            v = _context(v_pool, s, meta.block_size)
            o = F.scaled_dot_product_attention(
                q.reshape(1, num_kv_heads, rep, head_dim), k[None], v[None], scale=scaling
            )
            outs.append(o.reshape(num_heads, 1, head_dim))
            continue
        if s.fresh:
            k = key[0, :, s.q_start : s.q_start + s.q_len]
            v = value[0, :, s.q_start : s.q_start + s.q_len]
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=scaling, enable_gqa=rep > 1
            )
        else:
            k = _context(k_pool, s, meta.block_size)
            v = _context(v_pool, s, meta.block_size)
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=s.mask, scale=scaling, enable_gqa=rep > 1
            )
        outs.append(o[0])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [heads, T, D]
    return out.transpose(0, 1).unsqueeze(0), None


_registered = False


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    _registered = True
