"""oneDNN-prepacked linear layers: same numbers as nn.Linear (to float rounding) for every row
count the engine uses, every Linear of a transformers model swapped, and no swap where the ops
do not apply. (Greedy tokens with and without packing equal transformers' generate:
test_batching.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine import cpu_linear
from services.worker.engine.model_loading import load_model

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


# Run in a fresh interpreter: oneDNN and ideep read their cache capacity once per process.
_KERNEL_CACHE_CHILD = """
import ctypes, sys, torch
from services.worker.engine import cpu_linear
cpu_linear.bound_kernel_caches(int(sys.argv[1]))
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
def rss_mib():
    libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
packed = cpu_linear.PackedLinear(torch.nn.Linear(64, 64))
x = torch.randn(400, 64)
with torch.inference_mode():
    packed(x[:1])
    before = rss_mib()
    for rows in range(2, 202):  # 200 input shapes, as prompts of 200 lengths give a prefill worker
        packed(x[:rows])
    print(rss_mib() - before)
"""


def _kernel_cache_growth_mib(capacity: int) -> float:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _KERNEL_CACHE_CHILD, str(capacity)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc for RSS")
def test_bounded_kernel_caches_keep_memory_flat_over_many_shapes() -> None:
    """The soak's prefill-worker growth: every new row count leaves ~0.3 MiB in each of oneDNN's
    two kernel caches. Bounded, 200 shapes add (almost) nothing; with the libraries' default
    capacity (1,024) the same 200 shapes add tens of MiB."""
    bounded = _kernel_cache_growth_mib(8)
    unbounded = _kernel_cache_growth_mib(1024)
    assert bounded < 16, f"bounded caches grew {bounded:.1f} MiB over 200 shapes"
    assert unbounded > 3 * max(bounded, 8), f"unbounded {unbounded:.1f} MiB vs bounded {bounded:.1f}"


def test_engine_bounds_kernel_caches_before_loading(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in cpu_linear._KERNEL_CACHE_VARS:
        monkeypatch.setenv(var, "1024")  # restored after the test
    make_engine(cpu_kernel_cache_entries=7)
    for var in cpu_linear._KERNEL_CACHE_VARS:
        assert os.environ[var] == "7"


def test_kernel_cache_capacity_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        cpu_linear.bound_kernel_caches(-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17])
def test_row_copy_matches_nn_linear_and_serves_only_few_rows(
    rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the row copy, steps of up to 16 rows take it (panels [N/16, K, 16] through the panel
    kernel) and larger ones oneDNN's kernel; both give nn.Linear's numbers."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 224, bias=bias)
    packed = cpu_linear.PackedLinear(linear, row_copy=True)
    assert packed.row_weight is not None and packed.row_weight.shape == (14, 96, 16)
    used: list[bool] = []
    real = cpu_linear._by_rows

    def spy(x: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor | None:
        out = real(x, row_weight)
        used.append(out is not None)
        return out

    monkeypatch.setattr(cpu_linear, "_by_rows", spy)
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        want = linear(x)
        got = packed(x)
    assert used == [rows <= cpu_linear.row_copy_max_rows(packed.row_weight)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_fused_add_and_mul_equal_the_separate_ops(rows: int) -> None:
    """linear_add / linear_mul (the lean forward's residual add and SwiGLU product) give exactly
    the separate op on PackedLinear's output, on either kernel: the lean forward stays
    bit-identical to transformers' modules."""
    torch.manual_seed(rows)
    packed = cpu_linear.PackedLinear(torch.nn.Linear(64, 96, bias=False), row_copy=True)
    x, other = torch.randn(rows, 64), torch.randn(rows, 96)
    w, r = packed.packed_weight, packed.row_weight
    with torch.inference_mode():
        y = packed(x)
        assert torch.equal(cpu_linear.linear_add(x, other, w, r), other + y)
        assert torch.equal(cpu_linear.linear_mul(x, other, w, r), other * y)


def test_no_row_copy_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output features not a multiple of 16, or bf16 weights: oneDNN's kernel only. No panel
    kernel on the machine (no compiler): the torch.matmul copy for 1-2 rows, same numbers."""
    assert cpu_linear.PackedLinear(torch.nn.Linear(64, 200), row_copy=True).row_weight is None
    assert cpu_linear.row_copy_of(torch.zeros(64, 32, dtype=torch.bfloat16)) is None
    assert cpu_linear.PackedLinear(torch.nn.Linear(64, 96)).row_weight is None  # not asked for
    from services.worker.engine import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_load", lambda: None)
    linear = torch.nn.Linear(64, 96)
    packed = cpu_linear.PackedLinear(linear, row_copy=True)
    assert packed.row_weight is not None and packed.row_weight.shape == (3, 64, 32)
    assert cpu_linear.row_copy_max_rows(packed.row_weight) == 2
    assert cpu_linear.PackedLinear(torch.nn.Linear(64, 80), row_copy=True).row_weight is None  # 80 % 32
    for rows in (1, 2, 3):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_prepacked_models_keep_every_panel_copy_in_one_huge_page_buffer() -> None:
    """prepack_linears(row_copy=True): every panel copy is a slice of one 2 MiB-aligned buffer,
    back to back, and the model computes what it did before."""
    from services.worker.engine import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no panel kernel (no compiler or no AVX2)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 48, bias=False))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        want = model(x)
    assert cpu_linear.prepack_linears(model, row_copy=True) == 2
    rows = [m.row_weight for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert len(rows) == 2 and rows[0] is not None and rows[1] is not None
    base = rows[0].untyped_storage().data_ptr()
    assert base % (2 << 20) == 0
    assert rows[0].data_ptr() == base and rows[1].data_ptr() == base + 96 * 64 * 4
    assert rows[1].untyped_storage().data_ptr() == base
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
