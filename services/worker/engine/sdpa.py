"""One attention call over gathered or viewed K/V: torch's SDPA, or, for a model with logit
soft-capping (which SDPA lacks), transformers' eager attention op for op. Shared by every
attention backend (attention.py, attention_batched.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor,  # [..., heads, q_len, D]
    k: torch.Tensor,  # [..., kv_heads, keys, D]
    v: torch.Tensor,
    scale: float | None,
    softcap: float | None,
    mask: torch.Tensor | None = None,  # bool (True: visible) or additive, broadcast to the scores
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA, or with a soft-cap transformers' eager attention op for op (matmul, scale, cap,
    mask, fp32 softmax, matmul): SDPA has no soft-cap."""
    rep = q.shape[-3] // k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=rep > 1
        )
    if rep > 1:  # transformers' repeat_kv: query head h reads KV head h // rep
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    w = torch.matmul(q, k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    w = w / softcap
    w = torch.tanh(w)
    w = w * softcap
    if is_causal:
        n = q.shape[-2]
        mask = torch.ones(n, k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - n)
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)
