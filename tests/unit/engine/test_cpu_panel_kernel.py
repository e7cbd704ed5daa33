"""engine/cpu_panel_kernel.py: the few-row fp32 product over panelled weights equals a float64
reference for every row count and shape (odd panel counts, row tiles of 8 / 4 / 2 / 1), gives the
same bits on AVX2 and AVX-512 and for a row alone or in any batch, and refuses bad input."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine import cpu_panel_kernel as kernel

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no panel kernel (no compiler or no AVX2)")

SHAPES = [(576, 576), (192, 576), (48, 64), (16, 8), (1536, 96), (80, 1536)]  # (N, K)


def isas() -> list[int]:
    return [kernel.ISA_AVX2, kernel.ISA_AVX512] if kernel.has_avx512() else [kernel.ISA_AVX2]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_a_float64_reference_for_every_row_count(n: int, k: int) -> None:
    torch.manual_seed(n + k)
    w = torch.randn(n, k)
    panels = kernel.panels_of(w)
    assert panels is not None and panels.shape == (n // 16, k, 16)
    for rows in range(1, 12):
        x = torch.randn(rows, k)
        want = x.double() @ w.double().T
        for isa in isas():
            got = kernel.panel_mm(x, panels, isa)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), SHAPES[:3])
def test_same_bits_on_every_isa_and_for_a_row_in_any_batch(n: int, k: int) -> None:
    torch.manual_seed(7)
    w = torch.randn(n, k)
    panels = kernel.panels_of(w)
    assert panels is not None
    x = torch.randn(11, k)
    full = kernel.panel_mm(x, panels)
    for isa in isas():
        assert torch.equal(kernel.panel_mm(x, panels, isa), full)
    for i in range(11):  # alone, and as the last row of batches of every size
        assert torch.equal(kernel.panel_mm(x[i : i + 1], panels), full[i : i + 1])
        assert torch.equal(kernel.panel_mm(x[: i + 1], panels)[i], full[i])


def test_refuses_what_it_cannot_compute() -> None:
    w = torch.randn(32, 8)
    panels = kernel.panels_of(w)
    assert panels is not None
    with pytest.raises(RuntimeError, match="inner sizes"):
        kernel.panel_mm(torch.randn(2, 9), panels)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.panel_mm(torch.randn(2, 8, dtype=torch.float64), panels)
    # layouts it does not take: no panels at all
    assert kernel.panels_of(torch.randn(40, 8)) is None  # 40 features: not whole panels
    assert kernel.panels_of(torch.randn(32, 8, dtype=torch.bfloat16)) is None
