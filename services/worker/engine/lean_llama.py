"""A lean forward pass for Llama-architecture models over the paged KV pool (issue 15, item 3).

Owns `LeanLlama`: the same layers, weights and float operations as transformers'
`modeling_llama`, run as one flat loop of kernel calls instead of transformers' module tree.

Why: a decode step is mostly dispatch on the CPUs this project serves on. transformers'
`LlamaDecoderLayer` issues ~84 aten ops per layer (RMSNorm's dtype round trips, `rotate_half`'s
slices, negation and concatenation, views and reshapes around every projection) plus Python module
calls and decorators; with one sequence that is ~2,500 ops per step. This loop issues ~40 per
layer: RoPE is `x * cos + roll(x) * sin_signed` (roll by half the head = `rotate_half` with its
sign moved into a precomputed sin), the residual adds and the SwiGLU product ride on the linear
kernel (oneDNN binary post-ops on CPU), and the 2-D hidden state needs no reshapes.

Numerics: every value is computed by the same fp32 operation as in transformers, so outputs are
bit-identical on CPU: the roll reorders elements exactly, `-x * sin == x * -sin` exactly, and a
oneDNN post-op adds or multiplies the finished fp32 accumulator (one rounding, as the separate op
does). `tests/unit/engine/test_lean_llama.py` checks logits for equality, not closeness.

Supported: `LlamaForCausalLM` and `MistralForCausalLM` (the same decoder; Mistral's sliding
window is the attention metadata's, per layer) without projection biases, SiLU MLP, no
tensor-parallel pretraining split. Anything else keeps transformers' forward (`LeanLlama.supports`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from services.worker.engine import attention, cpu_linear
from services.worker.engine.cpu_linear import PackedLinear

# Models whose decoder is Llama's, op for op (Mistral: Llama plus a sliding window, which the
# attention metadata carries per layer).
_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


class _Linear:
    """One projection: the prepacked kernels of cpu_linear (oneDNN with fused post-ops, or the
    panel kernel for steps of up to 16 rows, exactly as PackedLinear's forward) or torch's matmul."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.packed = isinstance(module, PackedLinear)
        weight = module.packed_weight if self.packed else module.weight
        assert isinstance(weight, torch.Tensor)
        self.weight: torch.Tensor = weight  # oneDNN's blocked layout when packed, else [out, in]
        row = module.row_weight if self.packed else None
        self.row_weight: torch.Tensor | None = row if isinstance(row, torch.Tensor) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return cpu_linear.linear(x, self.weight, self.row_weight)
        return F.linear(x, self.weight)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T"""
        if self.packed:
            return cpu_linear.linear_add(x, residual, self.weight, self.row_weight)
        return residual + F.linear(x, self.weight)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other * x W^T"""
        if self.packed:
            return cpu_linear.linear_mul(x, other, self.weight, self.row_weight)
        return other * F.linear(x, self.weight)


class _Layer:
    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.module = attn  # the attention function reads module.layer_idx
        self.q, self.k, self.v, self.o = (
            _Linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.gate, self.up, self.down = (_Linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        self.scaling = float(attn.scaling)


class LeanLlama:
    """Forward of a loaded (optionally prepacked) transformers Llama model, same weights."""

    def __init__(self, model: Any, kv_pool: torch.Tensor) -> None:
        cfg = model.config
        self.embed = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.layers = [_Layer(layer) for layer in model.model.layers[: cfg.num_hidden_layers]]
        self.norm_final = model.model.norm.weight
        self.lm_head = _Linear(model.lm_head)
        self.eps = float(cfg.rms_norm_eps)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        # Per layer, views of the rank's KV pool [layers, 2, kv_heads, slots, D] (no copies):
        # K and V as [slots, kv_heads, D], written by slot, and as [1, kv_heads, slots, D], read
        # by a sequence's slot range.
        self.pool_views = [
            (kv_pool[i, 0].transpose(0, 1), kv_pool[i, 1].transpose(0, 1), kv_pool[i, 0:1], kv_pool[i, 1:2])
            for i in range(kv_pool.shape[0])
        ]

    @staticmethod
    def supports(model: Any) -> bool:
        cfg = model.config
        return (
            type(model).__name__ in _ARCHITECTURES
            and not getattr(cfg, "attention_bias", False)
            and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "hidden_act", None) == "silu"
            and getattr(cfg, "pretraining_tp", 1) == 1
        )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm, op for op (statistics in fp32)
        if x.dtype == torch.float32:
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _decode_attention(
        self,
        q: torch.Tensor,  # [B, heads, D], one query per sequence
        k: torch.Tensor,  # [B, kv_heads, D]
        v: torch.Tensor,
        views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        meta: attention.PagedAttentionMetadata,
        scaling: float,
    ) -> torch.Tensor:
        """A decode-only step: the PER_SEQ backend's per-sequence SDPA calls
        (attention.decode_attention), without the [1, heads, T, D] transposes transformers'
        attention interface needs."""
        k_slots, v_slots, k_pool, v_pool = views
        k_slots.index_copy_(0, meta.slots, k)
        v_slots.index_copy_(0, meta.slots, v)
        rep = self.num_heads // self.num_kv_heads
        queries = q.view(-1, self.num_kv_heads, rep, self.head_dim)
        return attention.decode_attention(
            queries,
            k_pool,
            v_pool,
            meta.seqs,
            meta.block_size,
            scaling,
            meta.decode_spans,
            meta.decode_starts,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of the step
        positions: torch.Tensor,  # [T]
        meta: attention.PagedAttentionMetadata,
        logits_idx: torch.Tensor | None,  # packed rows to compute logits for; None = no LM head
    ) -> torch.Tensor | None:
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        cos, sin = self.rotary(h, positions[None])  # [1, T, D] each, exactly as transformers
        half = self.head_dim // 2
        cos = cos.view(num_tokens, 1, self.head_dim)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign moves onto sin
        sin = sin.view(num_tokens, 1, self.head_dim).clone()
        sin[..., :half].neg_()
        q_shape = (num_tokens, self.num_heads, self.head_dim)
        kv_shape = (num_tokens, self.num_kv_heads, self.head_dim)
        decode_only = meta.groups is None and meta.num_decode == num_tokens
        for i, (layer, views) in enumerate(zip(self.layers, self.pool_views, strict=True)):
            x = self._rms_norm(h, layer.norm_in)
            q = layer.q(x).view(q_shape)
            k = layer.k(x).view(kv_shape)
            v = layer.v(x).view(kv_shape)
            q = (q * cos).add_(q.roll(half, -1).mul_(sin))
            k = (k * cos).add_(k.roll(half, -1).mul_(sin))
            if decode_only:
                # this layer's metadata: its sliding window's, if it has one
                o = self._decode_attention(q, k, v, views, meta.for_layer(i), layer.scaling)
            else:
                o, _ = attention.paged_attention_forward(
                    layer.module,
                    q.transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0),
                    None,
                    scaling=layer.scaling,
                    paged_meta=meta,
                )
            h = layer.o.add(o.reshape(num_tokens, -1), h)
            x = self._rms_norm(h, layer.norm_post)
            g = F.silu(layer.gate(x))
            h = layer.down.add(layer.up.mul(x, g), h)
        if logits_idx is None:
            return None
        return self.lm_head(self._rms_norm(h.index_select(0, logits_idx), self.norm_final))
