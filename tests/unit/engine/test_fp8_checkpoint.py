"""Checkpoints stored in FP8 already (engine/fp8_checkpoint.py): compressed-tensors' float-quantized
format (per-channel and per-tensor scales) and fbgemm_fp8 load as they are into FP8 modules and
serve the tokens the same weights quantized at load serve; other quantized formats are refused
with their name. The checkpoints are written here from the tiny model, as llm-compressor writes
them (an FP8 `weight` and its `weight_scale` per linear layer, the LM head in `ignore`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.engine import fp8_checkpoint
from services.worker.engine.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_weight
from services.worker.engine.model_loading import load_model
from shared.errors import InvalidArgument
from tests.unit.engine.conftest import EngineFactory, greedy_tokens

CPU = torch.device("cpu")
PROMPTS = [(5, 17, 99, 23, 41), (300, 12, 9), tuple(range(50, 70))]


def _compressed_tensors(strategy: str) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def write_fp8_checkpoint(
    source: Path, dest: Path, quantization_config: dict[str, Any], per_tensor: bool = False, keep: str = ""
) -> Path:
    """`source` (an unquantized folder) as an FP8 checkpoint in `dest`: every decoder linear
    weight (but `keep`, a name suffix left unquantized) as float8 e4m3 with its weight_scale,
    [out, 1] per channel or [1] per tensor."""
    shutil.copytree(source, dest)
    (dest / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        linear = ".layers." in key and key.endswith("_proj.weight") and not (keep and key.endswith(keep))
        if not linear:
            out[key] = value
            continue
        if per_tensor:
            scale = value.abs().amax().float().reshape(1) / FP8_MAX
            out[key] = (value.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            q, scale = quantize_weight(value)
            out[key], scale = q, scale.reshape(-1, 1)
        out[key.removesuffix(".weight") + ".weight_scale"] = scale
    save_file(out, str(dest / "model.safetensors"))
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def per_channel(tiny_bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("fp8ckpt") / "channel"
    return write_fp8_checkpoint(tiny_bpe, dest, _compressed_tensors("channel"))


def test_an_fp8_checkpoint_loads_its_weights_as_they_are(tiny_bpe: Path, per_channel: Path) -> None:
    model = load_model(str(per_channel), CPU, torch.float32, prepack=False)
    online = load_model(str(tiny_bpe), CPU, torch.float32, prepack=False, quantization="fp8")
    stored = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(stored) == 7 * len(model.model.layers)
    for a, b in zip(stored, [m for m in online.modules() if isinstance(m, Fp8Linear)], strict=True):
        assert torch.equal(a.weight_fp8.view(torch.uint8), b.weight_fp8.view(torch.uint8))
        assert torch.equal(a.weight_scale, b.weight_scale) and a.weight_scale.shape == (1, a.out_features)
    assert type(model.lm_head) is torch.nn.Linear  # in `ignore`: stored unquantized
    assert torch.equal(model.lm_head.weight, online.lm_head.weight)
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]


async def test_an_fp8_checkpoint_serves_the_tokens_of_its_weights_quantized_at_load(
    tiny_bpe: Path, per_channel: Path, make_engine: EngineFactory
) -> None:
    stored = await greedy_tokens(make_engine(per_channel), PROMPTS, 10)
    online = await greedy_tokens(make_engine(tiny_bpe, quantization="fp8"), PROMPTS, 10)
    assert stored == online


def test_per_tensor_scales_and_unquantized_layers_load_too(tiny_bpe: Path, tmp_path: Path) -> None:
    path = write_fp8_checkpoint(
        tiny_bpe, tmp_path / "tensor", _compressed_tensors("tensor"), per_tensor=True, keep="down_proj.weight"
    )
    model = load_model(str(path), CPU, torch.float32, prepack=False)
    reference = load_model(str(tiny_bpe), CPU, torch.float32, prepack=False)
    layer, ref = model.model.layers[0], reference.model.layers[0]
    assert type(layer.mlp.down_proj) is torch.nn.Linear  # stored unquantized: loaded as it is
    assert torch.equal(layer.mlp.down_proj.weight, ref.mlp.down_proj.weight)
    q = layer.self_attn.q_proj
    assert isinstance(q, Fp8Linear) and q.weight_scale.unique().numel() == 1  # one scale, every channel
    back = q.weight_fp8.float() * q.weight_scale.t()
    w = ref.self_attn.q_proj.weight
    assert ((back - w).abs() <= w.abs() / 16 + q.weight_scale.max() * 2.0**-9).all()


def test_fbgemm_fp8_checkpoints_are_served(tiny_bpe: Path, tmp_path: Path) -> None:
    path = write_fp8_checkpoint(tiny_bpe, tmp_path / "fbgemm", {"quant_method": "fbgemm_fp8"})
    model = load_model(str(path), CPU, torch.float32, prepack=False)
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "awq"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
            },
            "4-bit int",
        ),
    ],
)
def test_other_quantized_checkpoints_are_refused_with_their_name(config: dict[str, Any], named: str) -> None:
    class Config:
        quantization_config = config

    with pytest.raises(InvalidArgument, match=named):
        fp8_checkpoint.scheme(Config())
    assert fp8_checkpoint.scheme(object()) is None  # not quantized
