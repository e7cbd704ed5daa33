"""oneDNN-prepacked linear layers: same numbers as nn.Linear (to float rounding) for every row
count the engine uses, every Linear of a transformers model swapped, and no swap where the ops
do not apply. (Greedy tokens with and without packing equal transformers' generate:
test_batching.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine import cpu_linear
from services.worker.engine.model_runner import load_model

pytestmark = pytest.mark.skipif(
    not cpu_linear.prepack_available(torch.device("cpu"), torch.float32),
    reason="this torch build has no oneDNN linear ops",
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_packed_linear_matches_nn_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 200, bias=bias)
    packed = cpu_linear.PackedLinear(linear)
    x = torch.randn(1, rows, 96)  # the engine's packed [1, T, hidden] layout
    with torch.inference_mode():
        want = linear(x)
        got = packed(x)
    assert got.shape == want.shape == (1, rows, 200)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not cpu_linear.prepack_available(torch.device("cpu"), torch.bfloat16),
    reason="no oneDNN bf16 support on this CPU",
)
def test_packed_linear_in_bfloat16() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = cpu_linear.PackedLinear(linear)(x)
        want = linear(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_packed_linear_takes_non_contiguous_rows() -> None:
    linear = torch.nn.Linear(32, 8)
    packed = cpu_linear.PackedLinear(linear)
    x = torch.randn(1, 10, 64)[..., ::2]  # a strided view, as logits_to_keep selections are
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_every_linear_of_a_model_is_packed(tiny_bpe: Path) -> None:
    cpu = torch.device("cpu")
    plain = load_model(str(tiny_bpe), cpu, torch.float32, prepack=False)
    packed = load_model(str(tiny_bpe), cpu, torch.float32)
    n_linear = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert n_linear > 0
    assert sum(type(m) is torch.nn.Linear for m in packed.modules()) == 0
    assert sum(isinstance(m, cpu_linear.PackedLinear) for m in packed.modules()) == n_linear
    # the LM head is repacked while the (tied) embedding keeps its own weight
    prompt = torch.tensor([[5, 17, 42, 99, 3, 250, 8, 8, 61]])
    with torch.inference_mode():
        hidden = plain.model.embed_tokens(prompt)
        torch.testing.assert_close(packed.model.embed_tokens(prompt), hidden)
        torch.testing.assert_close(packed.lm_head(hidden), plain.lm_head(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("device", "dtype"), [("meta", torch.float32), ("cpu", torch.float16)])
def test_no_swap_where_prepacking_does_not_apply(device: str, dtype: torch.dtype) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(device=device, dtype=dtype)
    assert cpu_linear.prepack_linears(model) == 0
    assert type(model[0]) is torch.nn.Linear
