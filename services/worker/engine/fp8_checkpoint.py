"""Checkpoints whose linear weights are stored in FP8 already (the FP8 models people serve 70B
with: compressed-tensors' "float-quantized" format of llm-compressor / Red Hat AI's `-FP8` and
`-FP8-dynamic` models, and transformers' `fbgemm_fp8`, as Meta's Llama 3.1 405B FP8): their
weights loaded as they are into `Fp8Linear` modules (fp8.py), one decoder layer at a time, with
no bf16 copy of them on the device or in host memory.

Owns `scheme` (what a checkpoint's `quantization_config` says, and the refusal of the ones not
served) and `load` (the model made on the meta device, then every tensor read from the
safetensors files onto the device, each FP8 weight with its scale as one Fp8Linear).

Served: FP8 e4m3 weights with one scale per output channel or one per tensor (spread over the
channels; the same numbers). Activation scales are dynamic per token here whatever the
checkpoint says: a static `input_scale` is not read (vLLM uses it; the products differ by the
activation's rounding only). Block-wise scales (DeepSeek's 128x128 `weight_scale_inv`), INT4/INT8
(AWQ, GPTQ, compressed-tensors' int formats) and other methods are refused with their name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from services.worker.engine.fp8 import FP8, Fp8Linear, Fp8Weight
from shared.errors import InvalidArgument
from shared.model_store import finish_on_device, materialize

_SAFETENSORS_INDEX = "model.safetensors.index.json"


def scheme(config: Any) -> str | None:
    """ "fp8" for a checkpoint whose weights are FP8 as served here; None for an unquantized one.
    Raises InvalidArgument naming what a checkpoint quantized otherwise uses."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method", "")
    if method == "fbgemm_fp8":
        return "fp8"
    if method == "compressed-tensors" and _compressed_tensors_fp8(qc):
        return "fp8"
    raise InvalidArgument(
        f"the model's weights are quantized with {method or 'an unnamed method'} "
        f"({_describe(qc)}); pdserve serves FP8 e4m3 weights with per-channel or per-tensor "
        "scales (compressed-tensors float-quantized, fbgemm_fp8), or unquantized weights (which "
        "--quantization fp8 quantizes at load)"
    )


def _compressed_tensors_fp8(qc: dict[str, Any]) -> bool:
    groups = qc.get("config_groups") or {}
    if not groups:
        return False
    for group in groups.values():
        w = group.get("weights") or {}
        if not (
            w.get("num_bits") == 8
            and w.get("type") == "float"
            and w.get("strategy") in ("channel", "tensor")
            and not w.get("dynamic", False)
        ):
            return False
    return True


def _describe(qc: dict[str, Any]) -> str:
    groups = qc.get("config_groups") or {}
    if groups:
        w = next(iter(groups.values())).get("weights") or {}
        return f"{w.get('num_bits')}-bit {w.get('type')} weights, {w.get('strategy')} scales"
    return ", ".join(f"{k}={v}" for k, v in qc.items() if k in ("bits", "weight_block_size", "format"))


class _Tensors:
    """The checkpoint's tensors by name, read one at a time from its safetensors files."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / _SAFETENSORS_INDEX
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(folder.glob("*.safetensors"))]
        if not files:
            raise FileNotFoundError(f"no safetensors files in {folder}")
        self._handles = [safe_open(str(folder / f), framework="pt", device="cpu") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118 (not a dict)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        tensor: torch.Tensor = self._where[name].get_tensor(name)
        return tensor


def load(path: str | Path, device: torch.device, dtype: torch.dtype, **kwargs: Any) -> Any:
    """The model of an FP8 checkpoint on `device`: FP8 linear weights as Fp8Linear modules
    (their scales fp32, [1, out]), every other tensor in `dtype`. kwargs go to from_config
    (attn_implementation=...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    config = AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "quantization_config"):  # made here, not by transformers' quantizer
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    tensors = _Tensors(folder)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def stored(name: str, meta: torch.Tensor) -> torch.Tensor | None:
        if name not in tensors:
            if tied and name == "lm_head.weight":  # not stored apart: tied to the embedding
                return None
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return tensors.get(name).to(device=device, dtype=dtype)

    with torch.no_grad():
        names = {id(m): n for n, m in model.named_modules()}
        for layer in model.get_decoder().layers:  # one layer at a time on the device
            _fp8_linears(layer, names[id(layer)], tensors, device)
            materialize(layer, device, stored, names[id(layer)])
        materialize(model, device, stored)
    return finish_on_device(model, device)


def _fp8_linears(layer: torch.nn.Module, prefix: str, tensors: _Tensors, device: torch.device) -> None:
    """The layer's linear modules stored as FP8 (weight + weight_scale) become Fp8Linear."""
    for name, mod in list(layer.named_modules()):
        if type(mod) is not torch.nn.Linear:
            continue
        key = f"{prefix}.{name}"
        if f"{key}.weight_scale" not in tensors:
            continue  # kept unquantized (in the checkpoint's `ignore`)
        q = tensors.get(f"{key}.weight")
        if q.shape != mod.weight.shape:
            raise InvalidArgument(f"{key}.weight is {list(q.shape)}, the model's {list(mod.weight.shape)}")
        if q.dtype != FP8:
            raise InvalidArgument(f"{key}.weight is {q.dtype}, not float8_e4m3fn, beside its weight_scale")
        if mod.bias is not None:
            raise InvalidArgument(f"{key} has a bias: FP8 linear layers with biases are not served")
        scale = tensors.get(f"{key}.weight_scale").to(torch.float32).reshape(-1)
        out = q.shape[0]
        if scale.numel() == 1:  # one scale for the tensor: the same for every channel
            scale = scale.expand(out)
        if scale.numel() != out:
            raise InvalidArgument(
                f"{key}.weight_scale has {scale.numel()} values for {out} output channels "
                "(block-wise scales are not served)"
            )
        weight = Fp8Weight(q.to(device).contiguous(), scale.to(device).reshape(1, out).contiguous())
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, attr, Fp8Linear(weight, mod.weight.dtype))
