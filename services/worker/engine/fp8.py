"""FP8 weights (`--quantization fp8`, as vLLM's online FP8): the decoder layers' linear weights
stored as float8 e4m3 with one scale per output channel, their inputs quantized per token as
each product runs, the product itself torch's `_scaled_mm` (cuBLASLt's FP8 GEMM on a GPU).

Why: a decode step reads every weight once, so on a GPU it is bound by weight bytes; FP8 halves
them against bf16 (a Llama-3-8B shape: 15.0 GB of bf16 products become 7.0 GB + scales), which
halves the step's floor, and a 70B model's products (~130 GB in bf16, more than one H200 leaves
for a KV cache) take ~65 GB. Numerics follow vLLM's dynamic FP8 (W8A8): weight scale = the
channel's max |w| / 448, activation scale = the token's max |x| / 448, both fp32, accumulation
in fp32, the result in the activations' dtype. The embedding, the LM head, the norms and the KV
cache keep the model's dtype (vLLM keeps the head unquantized too).

Owns `Fp8Weight` (the quantized weight and its scales), `linear` (a product with either a plain
weight or an Fp8Weight: the lean forward's fused halves call it inside torch.compile, where the
type is a constant), `Fp8Linear` (the module that replaces nn.Linear, so transformers' own
forward runs FP8 too) and `quantize_linears`. Where it runs: CUDA GPUs of compute capability 9.0
or more (Hopper, Blackwell: torch runs row-wise scaled FP8 GEMMs there; Ada has FP8 tensor cores
but not those) and the CPU (torch's reference `_scaled_mm`, for tests; slower than the model's
dtype there).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from shared.errors import InvalidArgument

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
_MIN_SCALE = 1e-12  # an all-zero row's scale (its products are zero anyway)
# cuBLASLt's FP8 GEMM needs both dimensions of the weight to be multiples of 16
CUDA_ALIGN = 16
QUANTIZATIONS = ("", "fp8")


class Fp8Weight(NamedTuple):
    """A linear weight [out, in] as FP8 with one scale per output channel."""

    q: torch.Tensor  # [out, in] float8_e4m3fn, row-major
    scale: torch.Tensor  # [1, out] float32: w[o, :] ~= q[o, :] * scale[0, o]


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: scale = max |w| / 448 over the row, q = w / scale (saturating)."""
    w32 = w.detach().to(torch.float32)
    scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale.t().contiguous())


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the FP8 values stand for (tests, references)."""
    return (w.q.to(torch.float32) * w.scale.t()).to(dtype)


def cat(weights: list[Fp8Weight]) -> Fp8Weight:
    """Weights of projections of the same input as one (rows stacked): per-channel scales make
    this the same as quantizing the stacked weight."""
    # concatenated as bytes (the same values; cat of float8 tensors is not every build's kernel)
    q = torch.cat([w.q.view(torch.uint8) for w in weights]).view(FP8)
    return Fp8Weight(q, torch.cat([w.scale for w in weights], dim=1))


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [..., in] (the model's dtype) times w^T -> [..., out] in x's dtype: x quantized per
    token (row) with its own scale, the product accumulated in fp32 and scaled back."""
    rows = x.reshape(-1, x.shape[-1])
    x32 = rows.to(torch.float32)
    scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    xq = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # cuBLASLt's row-wise scaled FP8 GEMM writes bf16; elsewhere fp32 then the input's dtype
    out_dtype = x.dtype if x.dtype == torch.bfloat16 or x.device.type != "cuda" else torch.bfloat16
    out = torch._scaled_mm(xq, w.q.t(), scale_a=scale, scale_b=w.scale, out_dtype=out_dtype)
    return out.to(x.dtype).view(*x.shape[:-1], w.q.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x W^T with a plain weight or an FP8 one."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w)
    return F.linear(x, w)


class Fp8Linear(torch.nn.Module):
    """A bias-free nn.Linear whose weight is FP8: buffers `weight_fp8` [out, in] and
    `weight_scale` [1, out] (buffers, so moves, memory counts and state walks see them);
    `weight` stays an attribute of the original's shape and dtype on the meta device, for code
    that reads the shape."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, weight: Fp8Weight, dtype: torch.dtype) -> None:
        """weight: the FP8 values and scales; dtype: the model's (the meta `weight`'s)."""
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.register_buffer("weight_fp8", weight.q)
        self.register_buffer("weight_scale", weight.scale)
        self.weight = torch.empty(weight.q.shape, dtype=dtype, device="meta")

    @classmethod
    def from_linear(cls, module: torch.nn.Linear) -> Fp8Linear:
        """A bias-free nn.Linear quantized (quantize_weight)."""
        return cls(quantize_weight(module.weight), module.weight.dtype)

    @property
    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight_fp8, self.weight_scale)

    def set_fp8(self, w: Fp8Weight) -> None:
        """Point the module at other storage of the same values (a fused weight's rows)."""
        self.weight_fp8, self.weight_scale = w.q, w.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def weights_of(model: torch.nn.Module) -> str:
    """What the model's KV layout says of its weights (KvLayout.weights): "fp8" when its linear
    layers are FP8 (quantized at load or stored so), "" for the model's own."""
    return "fp8" if any(isinstance(m, Fp8Linear) for m in model.modules()) else ""


def check_supported(quantization: str, device: torch.device) -> None:
    """InvalidArgument naming the reason where `quantization` cannot run on `device`."""
    if quantization not in QUANTIZATIONS:
        raise InvalidArgument(f"--quantization {quantization!r}: choose one of {list(QUANTIZATIONS)}")
    if quantization != "fp8" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0):
        raise InvalidArgument(
            "--quantization fp8 needs a GPU of compute capability 9.0 or more (Hopper, Blackwell: "
            "row-wise scaled FP8 GEMMs); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )


def quantize_linears(model: Any, align: int = 1) -> int:
    """Replace the decoder layers' bias-free nn.Linear modules by Fp8Linear, in place (the LM
    head and embedding stay); returns how many (quantize_layer, layer by layer)."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    return sum(quantize_layer(layer, align) for layer in layers)


def quantize_layer(layer: torch.nn.Module, align: int = 1) -> int:
    """One decoder layer's bias-free nn.Linear modules as Fp8Linear, in place; returns how many.
    Each original weight is freed as its module goes. align: what both dimensions of a weight
    must be a multiple of (16 for cuBLASLt's FP8 GEMM); the projections of one input (q/k/v,
    gate/up), which the lean forward fuses, are quantized all or none."""
    linears = {name: mod for name, mod in layer.named_modules() if type(mod) is torch.nn.Linear}

    def fits(mod: torch.nn.Linear) -> bool:
        return mod.bias is None and mod.in_features % align == 0 and mod.out_features % align == 0

    keep = {name for name, mod in linears.items() if not fits(mod)}
    for group in _SAME_INPUT:
        names = {f"{prefix}.{proj}" for prefix, proj in group} & set(linears)
        if names & keep:
            keep |= names
    with torch.no_grad():
        for name, mod in linears.items():
            if name in keep:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, attr, Fp8Linear.from_linear(mod))
    if keep:
        log.warning(
            "fp8: %d linear layers of a decoder layer kept in the model's dtype (a bias, or a "
            "dimension not a multiple of %d)",
            len(keep),
            align,
        )
    return len(linears) - len(keep)


# projections of one input that the lean forward fuses into one product (lean_llama._Layer)
_SAME_INPUT = (
    (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj")),
    (("mlp", "gate_proj"), ("mlp", "up_proj")),
)
