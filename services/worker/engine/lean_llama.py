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

On CUDA (`fused=True`, issue 31) a decode step is bound by kernel count, not by the host: 8
sequences of a Llama-3-8B shape replayed as a CUDA graph took 8.7 ms against 3.6 ms to read the
weights once (H200), with ~40 small kernels per layer. So there the layer runs as few kernels:
the q/k/v projections as one matrix (and gate/up as one; the modules' weights become views of
the fused ones, no second copy), and the projection + RoPE (+ the K/V write into the pool, where
attention reads it in place) before attention and the residual + norm + MLP + residual + the
next layer's norm after it as two `torch.compile`d functions (Triton kernels for the element-wise
parts, cuBLAS for the products), compiled once for every layer and batch size. Each layer's last
residual add and the next layer's norm are one kernel so; the last layer's output leaves normed
by the final norm.
bf16 on a GPU is not bit-identical to transformers anyway; the CPU path above is unchanged.

Supported: `LlamaForCausalLM` and `MistralForCausalLM` (the same decoder; Mistral's sliding
window is the attention metadata's, per layer) without projection biases, SiLU MLP, no
tensor-parallel pretraining split. Anything else keeps transformers' forward (`LeanLlama.supports`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.engine import attention, cpu_linear, flex_paged, fp8
from services.worker.engine.cpu_linear import PackedLinear
from services.worker.engine.fp8 import Fp8Linear, Fp8Weight, linear
from services.worker.engine.lora import LoraModule

# Models whose decoder is Llama's, op for op (Mistral: Llama plus a sliding window, which the
# attention metadata carries per layer).
_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


class _Linear:
    """One projection: the prepacked kernels of cpu_linear (oneDNN with fused post-ops, or the
    panel kernel for steps of up to 16 rows, exactly as PackedLinear's forward), an FP8 product
    (fp8.py, --quantization fp8) or torch's matmul."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.packed = isinstance(module, PackedLinear)
        # the weight as the fused halves take it: [out, in], or its FP8 form
        self.w: torch.Tensor | Fp8Weight
        if isinstance(module, Fp8Linear):
            self.w = module.fp8
        else:
            weight = module.packed_weight if self.packed else module.weight
            assert isinstance(weight, torch.Tensor)
            self.w = weight  # oneDNN's blocked layout when packed
        row = module.row_weight if self.packed else None
        self.row_weight: torch.Tensor | None = row if isinstance(row, torch.Tensor) else None
        # the LoRA adapters that target this projection (lora.py), if any
        lora = getattr(module, "pdserve_lora", None)
        self.lora: LoraModule | None = lora if isinstance(lora, LoraModule) else None

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            assert isinstance(self.w, torch.Tensor)
            return cpu_linear.linear(x, self.w, self.row_weight)
        return linear(x, self.w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        if self.lora is not None and self.lora.active:
            return self.lora.apply(x, out)  # PEFT's order: base(x) + lora_B(lora_A(x)) * scaling
        return out

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T"""
        if self.lora is not None and self.lora.active:  # the adapted projection, then the add
            return residual + self(x)
        if self.packed:
            assert isinstance(self.w, torch.Tensor)
            return cpu_linear.linear_add(x, residual, self.w, self.row_weight)
        return residual + linear(x, self.w)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other * x W^T"""
        if self.lora is not None and self.lora.active:
            return other * self(x)
        if self.packed:
            assert isinstance(self.w, torch.Tensor)
            return cpu_linear.linear_mul(x, other, self.w, self.row_weight)
        return other * linear(x, self.w)


def _fuse(modules: list[Any]) -> torch.Tensor | Fp8Weight:
    """One [sum of out, in] weight (or FP8 weight) for projections of the same input; each
    module's weight becomes a view of it (the separate copies are freed). Idempotent: a second
    runner over the same model gets the same one (no second copy)."""
    done = getattr(modules[0], "pdserve_fused_weight", None)
    if isinstance(done, (torch.Tensor, Fp8Weight)):
        return done
    fused: torch.Tensor | Fp8Weight
    kinds = {isinstance(m, Fp8Linear) for m in modules}
    if len(kinds) > 1:  # fp8.quantize_linears keeps a layer's projections all FP8 or none
        raise ValueError("projections of one input are partly FP8: they cannot be fused")
    if kinds == {True}:
        fused = fp8.cat([m.fp8 for m in modules])
        start = 0
        for m in modules:
            rows = m.out_features
            m.set_fp8(Fp8Weight(fused.q[start : start + rows], fused.scale[:, start : start + rows]))
            start += rows
    else:
        fused = torch.cat([m.weight.detach() for m in modules])
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = fused[start : start + rows]
            start += rows
    modules[0].pdserve_fused_weight = fused
    return fused


class _Layer:
    def __init__(self, layer: Any, fused: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.module = attn  # the attention function reads module.layer_idx
        # fused (CUDA): [q + k + v, hidden] and [gate + up, hidden], before _Linear takes views
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj]) if fused else None
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj]) if fused else None
        self.q, self.k, self.v, self.o = (
            _Linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.gate, self.up, self.down = (_Linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight
        self.scaling = float(attn.scaling)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (statistics in fp32)."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _attn_in(
    x: torch.Tensor,  # [T, hidden], normed (the previous layer's _attn_out normed it)
    qkv: torch.Tensor | Fp8Weight,  # [(heads + 2 kv_heads) * D, hidden]
    cos: torch.Tensor,  # [T, 1, D]
    sin: torch.Tensor,  # [T, 1, D], sign of rotate_half folded in
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused path: one q/k/v product, RoPE -> q [T, heads, D], k, v [T, kv_heads, D]."""
    q, k, v = linear(x, qkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    half = head_dim // 2
    q = q.reshape(-1, heads, head_dim)
    k = k.reshape(-1, kv_heads, head_dim)
    q = q * cos + q.roll(half, -1) * sin
    k = k * cos + k.roll(half, -1) * sin
    return q, k, v.reshape(-1, kv_heads, head_dim)


def _attn_in_cached(
    x: torch.Tensor,  # [T, hidden], normed
    qkv: torch.Tensor | Fp8Weight,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_layer: torch.Tensor,  # [2, kv_heads, slots, D]: this layer's K and V in the pool
    slots: torch.Tensor,  # [T] the pool slot of each token
) -> torch.Tensor:
    """Fused path of steps that attend in place: `_attn_in`, and the tokens' K/V written to
    their slots in the same compiled graph -> q [T, heads, D]. Compiled, K's RoPE and V's copy
    become the scatter's inputs: one kernel writes both (inductor on CPU: one kernel for both
    RoPEs and the scatter), where two index_copy calls after RoPE kernels of their own cost
    three or four launches per layer (a graph decode step of the 8B shape was 642 small
    kernels at 8 sequences on an H200, each with its gap: cuda-step-profile-h200.json)."""
    q, k, v = _attn_in(x, qkv, cos, sin, heads, kv_heads, head_dim)
    kv_layer.index_copy_(2, slots, torch.stack([k, v]).transpose(1, 2))
    return q


def _attn_out(
    o: torch.Tensor,  # [T, heads * D] attention output
    h: torch.Tensor,  # [T, hidden] residual
    o_proj: torch.Tensor | Fp8Weight,
    norm: torch.Tensor,
    gate_up: torch.Tensor | Fp8Weight,  # [2 * intermediate, hidden]
    down: torch.Tensor | Fp8Weight,
    norm_next: torch.Tensor,  # the next layer's input norm (the final norm after the last)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused path: output projection + residual, norm, SwiGLU MLP + residual -> new h, and h
    normed for the next layer: the residual add and the next norm are one kernel this way, not
    an add here and a norm at the next layer's start."""
    h = h + linear(o, o_proj)
    gate, up = linear(_rms_norm(h, norm, eps), gate_up).chunk(2, -1)
    h = h + linear(F.silu(gate) * up, down)
    return h, _rms_norm(h, norm_next, eps)


def _paged_attention(
    layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: attention.PagedAttentionMetadata
) -> torch.Tensor:
    """q [T, heads, D], k, v [T, kv_heads, D] through attention.py's paged attention (the
    interface transformers calls, which writes K/V to their slots and picks the layer's window)."""
    o, _ = attention.paged_attention_forward(
        layer.module,
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        None,
        scaling=layer.scaling,
        paged_meta=meta,
    )
    return o


def _flex_rows(
    step: flex_paged.FlexPagedStep,
    q: torch.Tensor,  # [T, heads, D] of the packed step
    n: int,  # its first n rows: one query per sequence, the step's sequences in order
    kv_layer: torch.Tensor,  # [2, kv_heads, slots, D], this step's K/V already written
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The first n rows' attention through `step` (a decode bucket of B >= n sequences; the
    rows past n are its padding: their tables hold the scratch block) -> [n, heads, D]."""
    rows = q.new_zeros(step.num_seqs, q.shape[1], q.shape[2])
    rows[:n] = q[:n]
    return step.attend(rows, kv_layer[0], kv_layer[1], scale, window)[:n]


@functools.cache
def _compiled() -> tuple[Any, Any, Any, Any]:
    # dynamic: one compilation serves every step size (sizes 1 and 0 are specialized once more;
    # a draft model's shapes and other dtypes compile again)
    flex_paged.allow_compilations()
    return (
        torch.compile(_rms_norm, dynamic=True),
        torch.compile(_attn_in, dynamic=True),
        torch.compile(_attn_in_cached, dynamic=True),
        torch.compile(_attn_out, dynamic=True),
    )


class LeanLlama:
    """Forward of a loaded (optionally prepacked) transformers Llama model, same weights."""

    def __init__(
        self, model: Any, kv_pool: torch.Tensor, fused: bool = False, compiled: bool = False
    ) -> None:
        """fused: the CUDA layout (one q/k/v and one gate/up product per layer); compiled: its two
        fused halves through torch.compile (CUDA; eager otherwise, for tests)."""
        cfg = model.config
        self.embed = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.fused = fused
        self.norm: Any
        self.attn_in: Any
        self.attn_in_cached: Any
        self.attn_out: Any
        self.norm, self.attn_in, self.attn_in_cached, self.attn_out = (
            _compiled() if fused and compiled else (_rms_norm, _attn_in, _attn_in_cached, _attn_out)
        )
        self.layers = [_Layer(layer, fused) for layer in model.model.layers[: cfg.num_hidden_layers]]
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
        self.layer_pools = [kv_pool[i] for i in range(kv_pool.shape[0])]  # [2, kv_heads, slots, D]

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
        return _rms_norm(x, weight, self.eps)

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
        # a step with LoRA rows runs the unfused layers: the fused halves have no place for
        # the adapters' per-row deltas (graphs never see such a step: model_runner.execute)
        if self.fused and meta.lora is None:  # the last layer's output comes out normed by the final norm
            x = self._fused_layers(h, cos, sin, meta)
            return None if logits_idx is None else self.lm_head(x.index_select(0, logits_idx))
        h = self._layers(h, cos, sin, meta)
        if logits_idx is None:
            return None
        return self.lm_head(self._rms_norm(h.index_select(0, logits_idx), self.norm_final))

    def _layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: attention.PagedAttentionMetadata
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        half = self.head_dim // 2
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
                o = _paged_attention(layer, q, k, v, meta)
            h = layer.o.add(o.reshape(num_tokens, -1), h)
            x = self._rms_norm(h, layer.norm_post)
            g = F.silu(layer.gate(x))
            h = layer.down.add(layer.up.mul(x, g), h)
        return h

    def _fused_layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: attention.PagedAttentionMetadata
    ) -> torch.Tensor:
        """The CUDA layout: two fused halves per layer around attention, which reads the pool in
        place (FlexAttention, static steps) or through attention.py (other steps) -> the last
        layer's output normed by the final norm [T, hidden]."""
        num_tokens = h.shape[0]
        flex = meta.flex
        if flex is not None:
            flex.prepare()
        short = meta.flex_short  # a mixed step's decode rows, in place (attention.py)
        if short is not None:
            short[0].prepare()
        windows = meta.layer_windows or (None,) * len(self.layers)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        x = self.norm(h, self.layers[0].norm_in, self.eps)
        for i, (layer, kv_layer, window) in enumerate(
            zip(self.layers, self.layer_pools, windows, strict=True)
        ):
            assert layer.qkv is not None and layer.gate_up is not None
            if flex is not None:
                q = self.attn_in_cached(x, layer.qkv, cos, sin, *shape, kv_layer, meta.slots)
                o = flex.attend(q, kv_layer[0], kv_layer[1], layer.scaling, window)
            else:
                q, k, v = self.attn_in(x, layer.qkv, cos, sin, *shape)
                o = _paged_attention(layer, q, k, v, meta)  # writes every row's K/V first
                if short is not None:
                    o[0, : short[1]] = _flex_rows(short[0], q, short[1], kv_layer, layer.scaling, window)
            last = i + 1 == len(self.layers)
            h, x = self.attn_out(
                o.reshape(num_tokens, -1),
                h,
                layer.o.w,
                layer.norm_post,
                layer.gate_up,
                layer.down.w,
                self.norm_final if last else self.layers[i + 1].norm_in,
                self.eps,
            )
        return x
