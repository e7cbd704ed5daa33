"""FP8 weights (`--quantization fp8`, engine/fp8.py): the quantization and the product against
their definitions, the modules a model's decoder gets, and the engine's paths over an FP8 model
(the lean forward, its fused CUDA layout run eagerly here, the whole engine) against
transformers' own forward over the same FP8 modules. torch's `_scaled_mm` runs on the CPU, so
all of it is checked in CI; on a GPU of compute capability 9.0+ the same code runs the FP8
GEMM (window part `engine`'s fp8 run measures it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.engine_floor import weight_bytes_per_step
from services.worker.engine import fp8
from services.worker.engine.fp8 import FP8, FP8_MAX, Fp8Linear, dequantize, fp8_linear, quantize_weight
from services.worker.engine.lean_llama import LeanLlama
from services.worker.engine.model_loading import load_model
from shared.errors import InvalidArgument
from tests.unit.engine.conftest import EngineFactory, greedy_tokens, hf_greedy
from tests.unit.engine.test_decode_graphs import _check_static_equals_plain
from tests.unit.engine.test_lean_llama import _assert_identical, _both_forwards

CPU = torch.device("cpu")


def test_a_weight_is_quantized_per_output_channel_within_e4m3s_precision() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g) * torch.logspace(-3, 2, 48)[:, None]  # rows of any scale
    q = quantize_weight(w)
    assert q.q.dtype == FP8 and q.q.shape == (48, 32) and q.scale.shape == (1, 48)
    # each row's largest magnitude maps to 448 (e4m3's largest) exactly
    assert torch.equal(q.q.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    back = dequantize(q)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value (plus the subnormal step of its row)
    step = q.scale.t() * 2.0**-9
    assert ((back - w).abs() <= w.abs() / 16 + step).all()


def test_the_product_is_the_product_of_the_quantized_operands() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g), torch.randn(96, 64, generator=g)
    wq = quantize_weight(w)
    got = fp8_linear(x, wq)
    # what the definition says: x quantized per row with its own scale, times the FP8 weight
    sx = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    xq = (x / sx).to(FP8).float() * sx
    torch.testing.assert_close(got, xq @ dequantize(wq).t(), rtol=1e-5, atol=1e-5)
    # and close to the full-precision product (quantization error only)
    exact = F.linear(x, w)
    assert ((got - exact).norm() / exact.norm()) < 0.06
    # rows are quantized on their own: a row 1000x larger beside it leaves a row's product as
    # it was (one scale for the whole input would flush the small row's values)
    louder = x.clone()
    louder[0] *= 1000
    torch.testing.assert_close(fp8_linear(louder, wq)[1:], got[1:], rtol=1e-5, atol=1e-5)
    # any leading shape
    assert fp8_linear(x.view(5, 1, 64), wq).shape == (5, 1, 96)


def test_a_decoder_gets_fp8_projections_and_keeps_its_head(tiny_bpe: Path) -> None:
    model = load_model(str(tiny_bpe), CPU, torch.float32, prepack=False, quantization="fp8")
    layers = model.model.layers
    per_layer = 7  # q, k, v, o, gate, up, down
    quantized = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(quantized) == per_layer * len(layers)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.float32
    proj = layers[0].self_attn.q_proj
    assert proj.weight_fp8.dtype == FP8 and proj.weight.device.type == "meta"  # no dense copy kept
    plain = load_model(str(tiny_bpe), CPU, torch.float32, prepack=False)
    dense_bytes = sum(
        4 * m.weight.numel() for m in plain.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    saved = weight_bytes_per_step(plain, 1) - weight_bytes_per_step(model, 1)
    assert saved > 0.7 * dense_bytes  # fp32 -> fp8: 3 of every 4 bytes (scales aside)


def test_projections_of_one_input_are_quantized_all_or_none(tiny_bpe: Path) -> None:
    """With an alignment no q/k/v dimension meets, none of them is FP8 (the lean forward fuses
    them into one product)."""
    model = load_model(str(tiny_bpe), CPU, torch.float32, prepack=False)
    q_out = model.model.layers[0].self_attn.q_proj.out_features
    k_out = model.model.layers[0].self_attn.k_proj.out_features
    align = next(a for a in (2**i for i in range(1, 12)) if q_out % a == 0 and k_out % a)
    fp8.quantize_linears(model, align)
    attn = model.model.layers[0].self_attn
    kinds = {type(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert kinds == {torch.nn.Linear}


def test_unknown_quantizations_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="int4"):
        fp8.check_supported("int4", CPU)
    fp8.check_supported("fp8", CPU)  # the CPU runs it (tests)


@pytest.mark.parametrize("block_size", [1, 4])
def test_the_lean_forward_over_fp8_weights_equals_transformers_forward(
    tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch, block_size: int
) -> None:
    """Same FP8 modules, same products: logits and KV bit-identical, as without FP8."""
    model = load_model(str(tiny_bpe), CPU, torch.float32, quantization="fp8")
    assert LeanLlama.supports(model)
    _assert_identical(*_both_forwards(model, block_size, monkeypatch))


def test_the_fused_cuda_layout_over_fp8_weights_decodes_the_same_tokens(tiny_bpe: Path) -> None:
    """The CUDA layout fuses q/k/v and gate/up into one FP8 product each (scales per channel,
    so the same values) and runs static decode steps; run eagerly here."""
    _check_static_equals_plain(tiny_bpe, CPU, fused=True, tolerance=1e-4, quantization="fp8")


async def test_an_fp8_engine_decodes_as_transformers_does_over_the_same_weights(
    tiny_bpe: Path, make_engine: EngineFactory
) -> None:
    from transformers import AutoModelForCausalLM

    engine = make_engine(quantization="fp8", max_batch_tokens=16)  # prompts in chunks
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    with torch.no_grad():
        assert fp8.quantize_linears(reference) > 0
    prompts = [(5, 17, 99, 23, 41), (300, 12, 9), tuple(range(50, 70))]
    got = await greedy_tokens(engine, prompts, 12)
    assert got == [hf_greedy(reference, p, 12) for p in prompts]
    # its KV is other KV than the model's own: it moves only to workers of FP8 weights too
    assert engine.kv_layout.weights == "fp8"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_on_the_gpu_matches_the_cpu_reference() -> None:
    """cuBLASLt's FP8 GEMM (row-wise scales, bf16 out) against the CPU's _scaled_mm of the same
    operands; a GPU below compute capability 9.0 is refused with its name."""
    dev = torch.device("cuda")
    try:
        fp8.check_supported("fp8", dev)
    except InvalidArgument as exc:
        assert "9.0" in str(exc)
        return
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(33, 4096, generator=g), torch.randn(1024, 4096, generator=g) / 64
    wq = quantize_weight(w)
    want = fp8_linear(x, wq)
    got = fp8_linear(x.to(dev, torch.bfloat16), fp8.Fp8Weight(wq.q.to(dev), wq.scale.to(dev)))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, rtol=0.02, atol=0.02)
