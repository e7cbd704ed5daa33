"""Loading a model for the engine: transformers' own class with the paged attention registered,
checked against the attention variants the engine reproduces (model_variants.py), its decoder
layers' products in FP8 if asked (fp8.py), its linear layers prepacked on CPU (cpu_linear.py);
its KV layout; dtype names."""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.worker.engine import attention, cpu_linear, fp8, fp8_checkpoint, model_variants
from services.worker.engine.api import KvLayout
from shared.model_store import load_causal_lm

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPES[name]


def load_model(
    model_path: str,
    device: torch.device,
    dtype: torch.dtype,
    prepack: bool = True,
    row_copy: bool = False,
    quantization: str = "",
) -> Any:
    """transformers' own model class with our attention; with quantization "fp8" its decoder
    layers' products in FP8 (fp8.py); on CPU its other linear layers prepacked for oneDNN
    unless `prepack` is False, with `row_copy` also as a copy for steps of few rows (see
    cpu_linear). Raises model_variants.UnsupportedAttention (before loading weights) for a model
    whose attention the engine cannot reproduce exactly."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    model_variants.check_supported(config)
    attention.register()
    # a checkpoint stored in FP8 is served in FP8 (InvalidArgument for other quantized ones)
    stored_fp8 = fp8_checkpoint.scheme(config) == "fp8"
    fp8.check_supported("fp8" if stored_fp8 else quantization, device)
    if stored_fp8:
        model = fp8_checkpoint.load(
            model_path, device, dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
        )
        log.info("fp8: the checkpoint's FP8 weights loaded as they are")
        return _ready(model, prepack, row_copy)
    quantized: list[int] = []

    def to_fp8(layer: Any) -> None:
        """Each decoder layer as it reaches the device: its products in FP8, so the device
        never holds more than one layer in `dtype` (a 70B model's bf16 weights would not fit
        on one GPU beside anything)."""
        quantized.append(fp8.quantize_layer(layer, fp8.CUDA_ALIGN if device.type == "cuda" else 1))

    # a folder's weights, or a random-weight model built on the device (`random:` models)
    model = load_causal_lm(
        model_path,
        device,
        layer_hook=to_fp8 if quantization == "fp8" else None,
        dtype=dtype,
        attn_implementation=attention.ATTN_IMPLEMENTATION,
    )
    if quantized:
        if device.type == "cuda":  # the freed bf16 weights' segments back to the driver (KV pool)
            torch.cuda.empty_cache()
        log.info("fp8: %d linear layers quantized", sum(quantized))
    return _ready(model, prepack, row_copy)


def _ready(model: Any, prepack: bool, row_copy: bool) -> Any:
    model_variants.check_loaded(model)
    model.eval()
    # serving never differentiates: no autograd state in the weights (torch.compile'd layers
    # would otherwise trace for training)
    model.requires_grad_(False)
    if prepack:
        cpu_linear.prepack_linears(model, row_copy)
    return model


def kv_layout_of(model_config: Any, block_size: int, dtype: torch.dtype, weights: str = "") -> KvLayout:
    """The KV layout of a model's config; weights: fp8.weights_of(model) ("fp8" for FP8 linear
    weights: their KV is other KV than the model's own)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return KvLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        weights=weights,
    )
