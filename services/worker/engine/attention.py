"""Attention over the paged KV pool, plugged into transformers' own model classes.

`register()` adds the "pdserve_paged" implementation to transformers' AttentionInterface; models
loaded with attn_implementation="pdserve_paged" call `paged_attention_forward` in every layer with
our per-step `paged_meta` (forward kwargs flow down to the attention function).

Pool layout (one tensor per rank): [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]. Each step the packed tokens' K/V are written to their slots, then:
- decode-like sequences (one query token) attend in ONE batched SDPA call over their blocks
  gathered into a padded [B, kv_heads, max_blocks * block_size, head_dim] batch with a mask;
- prefill chunks attend one SDPA call each (causal over fresh K/V when nothing is cached, else
  over their gathered blocks with an explicit mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillSeq:
    q_start: int  # first packed position of this chunk
    q_len: int  # tokens in the chunk
    ctx_start: int  # tokens already in the cache before the chunk (positions 0..ctx_start-1)
    block_ids: torch.Tensor | None  # [num_blocks] covering ctx_start + q_len (None if ctx_start 0)
    mask: torch.Tensor | None  # [q_len, ctx_start + q_len] bool (None if ctx_start 0)


@dataclass
class PagedAttentionMetadata:
    kv_cache: torch.Tensor  # the rank's pool, layout above
    slot_blocks: torch.Tensor  # [T] block id of each packed token
    slot_offsets: torch.Tensor  # [T] row within that block
    decode_q_idx: torch.Tensor | None  # [B] packed positions of single-token sequences
    decode_block_table: torch.Tensor | None  # [B, max_blocks] (padding: block 0, masked)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSeq]


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
    k_pool = meta.kv_cache[layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]
    v_pool = meta.kv_cache[layer, 1]
    k_new = key[0].transpose(0, 1)  # [T, kv_heads, head_dim]
    v_new = value[0].transpose(0, 1)
    k_pool[meta.slot_blocks, meta.slot_offsets] = k_new
    v_pool[meta.slot_blocks, meta.slot_offsets] = v_new

    q = query[0]  # [heads, T, head_dim]
    num_heads, num_tokens, head_dim = q.shape
    out = query.new_empty(num_tokens, num_heads, head_dim)
    gqa = num_heads != key.shape[1]

    if meta.decode_q_idx is not None:
        assert meta.decode_block_table is not None
        bt = meta.decode_block_table
        batch = bt.shape[0]
        qd = q[:, meta.decode_q_idx].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, D]
        # [B, max_blocks, block_size, kv_heads, D] -> [B, kv_heads, max_kv, D]
        kd = k_pool[bt].reshape(batch, -1, k_pool.shape[2], head_dim).transpose(1, 2)
        vd = v_pool[bt].reshape(batch, -1, v_pool.shape[2], head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=gqa
        )
        out[meta.decode_q_idx] = od[:, :, 0]

    for p in meta.prefills:
        qp = q[:, p.q_start : p.q_start + p.q_len].unsqueeze(0)  # [1, heads, q, D]
        if p.block_ids is None:
            kp = key[:, :, p.q_start : p.q_start + p.q_len]
            vp = value[:, :, p.q_start : p.q_start + p.q_len]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            ctx = p.ctx_start + p.q_len
            kp = k_pool[p.block_ids].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
            vp = v_pool[p.block_ids].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, scale=scaling, enable_gqa=gqa
            )
        out[p.q_start : p.q_start + p.q_len] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


_registered = False


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    _registered = True
