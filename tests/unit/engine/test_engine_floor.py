"""The bench-engine floor probe: bytes and FLOPs a decode step must at least cost, the CPU
report, and a real (tiny) decode-step measurement against them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import engine_floor
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner


def _linear_weight_bytes(model: torch.nn.Module) -> int:
    return sum(m.in_features * m.out_features * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_weight_bytes_count_a_tied_head_once(tiny_bpe: Path) -> None:
    model = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32, prepack=False)
    embed = model.get_input_embeddings().weight
    norms = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)
    rows = 8 * embed.shape[1] * 4
    # untied: every linear (the head included) plus the 8 looked-up rows of the table
    assert engine_floor.weight_bytes_per_step(model, 8) == _linear_weight_bytes(model) + norms + rows
    model.get_output_embeddings().weight = embed  # tied: the head reads the table, once
    assert engine_floor.weight_bytes_per_step(model, 8) == _linear_weight_bytes(model) + norms


def test_weight_bytes_of_a_prepacked_model(tiny_bpe: Path) -> None:
    plain = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32, prepack=False)
    packed = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32)
    got = engine_floor.weight_bytes_per_step(packed, 8)
    # packed weights are the same numbers in another layout (possibly padded); the embedding
    # table is read for 8 rows only, in both
    want = engine_floor.weight_bytes_per_step(plain, 8)
    assert want <= got < want * 1.5


def test_flops_grow_with_batch_and_context(tiny_bpe: Path) -> None:
    model = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32)
    cfg = model.config
    linear = (
        _linear_weight_bytes(load_model(str(tiny_bpe), torch.device("cpu"), torch.float32, prepack=False))
        // 4
    )
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attn = 2 * 100 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    assert engine_floor.flops_per_step(model, 4, 100) == 2 * 4 * (linear + attn)


def test_cpu_features_report_torch_capability() -> None:
    cpu = engine_floor.cpu_features()
    assert cpu["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert cpu["torch"] == torch.__version__
    for key in ("avx2", "avx512f", "amx", "onednn_bf16"):
        assert isinstance(cpu[key], bool)


def test_decode_step_timing_and_report(tiny_bpe: Path) -> None:
    model = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32)
    layout = kv_layout_of(model.config, 4, torch.float32)
    runner = ModelRunner(model, layout, 40, torch.device("cpu"), torch.float32)
    wall, cpu = engine_floor.time_decode_steps(runner, batch=3, context=20, steps=2)
    assert wall > 0 and cpu > 0
    probe = {
        "cpu": engine_floor.cpu_features(),
        "context_tokens": 20,
        "step_threads": 1,
        "bandwidth_gb_s": {"single_core": 10.0, "all_cores": 15.0, "all_core_threads": 2},
        "gemm_gflop_s": 50.0,
        "steps": [
            {
                "seqs": 3,
                "step_ms": wall * 1e3,
                "step_cpu_ms": cpu * 1e3,
                "floor_ms": 1.0,
                "vs_floor": 2.0,
                "cpu_vs_floor": 1.5,
                "roofline_ms": 1.0,
                "vs_roofline": 2.0,
                "weight_mb": 1.0,
                "kv_mb": 0.1,
            }
        ],
    }
    probe["row_copy_steps"] = [{"seqs": 1, "with_row_copy_ms": 30.0, "without_ms": 60.0, "speedup": 2.0}]
    probe["cpu_kernels"] = {"available": True, "load_s": 0.2}
    # a mixed step: 2 decoding sequences + a 16-token prompt chunk in one forward
    probe["mixed_step"] = mixed = engine_floor.mixed_row(runner, model, 10e9, 50e9, 2, 16, 20)
    assert mixed["step_ms"] > 0 and mixed["roofline_ms"] > 0
    with pytest.raises(ValueError, match="do not fit"):
        engine_floor.time_mixed_step(runner, 3, 160, 20)
    # a burst's step: the prompt tokens as several fresh prompts
    burst = engine_floor.mixed_row(runner, model, 10e9, 50e9, 1, 16, 20, chunks=2)
    assert burst["prefill_prompts"] == 2 and burst["step_ms"] > 0
    with pytest.raises(ValueError, match="equal prompts"):
        engine_floor.time_mixed_step(runner, 1, 15, 20, chunks=2)
    lines = engine_floor.format_report(probe)
    assert any("mixed step (2 decoding + a 16-token prefill chunk, eager)" in line for line in lines)
    assert any("built or loaded in 0.2 s" in line for line in lines)
    assert any("3 seqs" in line and "2.00x" in line for line in lines)
    assert any("with the row copy" in line and "60.0 ms without" in line for line in lines)
