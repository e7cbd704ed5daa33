"""benchmarks/linear_kernels.py on a tiny stack: every kernel computes the same linears, the
record has what the README quotes, and the inductor contender leaves no global setting behind."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks import linear_kernels as lk


def tiny() -> lk.Stack:
    return lk.Stack(layers=2, hidden=32, mlp=64, kv=16)


def test_kernels_agree_and_the_record_names_rate_and_difference() -> None:
    stack = tiny()
    out = lk.measure([1, 3], layers=2, reps=2, contenders=["onednn_packed", "torch_linear"], stack=stack)
    assert out["weight_mb"] == round(stack.weight_bytes() / 1e6, 1)
    assert stack.weight_bytes() == 2 * 4 * (32 * 32 * 2 + 16 * 32 * 2 + 64 * 32 * 3)
    assert set(out["rows"]) == {"1", "3"}
    for row in out["rows"].values():
        assert set(row) == {"onednn_packed", "torch_linear"}
        for m in row.values():
            assert m["gb_s"] > 0 and m["ms"] > 0
            assert m["max_abs_diff"] < 1e-4  # the same linears, fp32 rounding apart


def test_the_panel_kernel_contender_computes_the_same_linears() -> None:
    from services.worker.engine import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no panel kernel (no compiler or no AVX2)")
    out = lk.measure([1, 8], layers=2, reps=2, contenders=["onednn_packed", "panel_kernel"], stack=tiny())
    for row in out["rows"].values():
        assert row["panel_kernel"]["gb_s"] > 0
        assert row["panel_kernel"]["max_abs_diff"] < 1e-4


def test_the_stack_applies_each_linear_to_its_input_width() -> None:
    stack = tiny()
    x, h = torch.randn(2, 32), torch.randn(2, 64)
    sums = stack(x, h)
    assert sums.shape == (len(stack.lins),) == (14,)
    down = stack.linears()[6]  # (out 32, in 64): the MLP's down projection reads h
    assert torch.allclose(sums[6], (h @ down.weight.T).sum())
    assert torch.allclose(sums[0], (x @ stack.linears()[0].weight.T).sum())


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler"
)
def test_inductor_contender_matches_and_restores_inductor_settings() -> None:
    import torch._inductor.config as inductor

    before = (inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends)
    out = lk.measure(
        [2], layers=1, reps=1, contenders=["onednn_packed", "inductor_cpp"], stack=lk.Stack(1, 32, 64, 16)
    )
    m = out["rows"]["2"]["inductor_cpp"]
    assert "skipped" not in m and m["max_abs_diff"] < 1e-4
    assert (inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends) == before
