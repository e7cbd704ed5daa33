"""engine/cpu_kernels.py: the few-row fp32 product over panelled weights equals a float64
reference for every row count and shape (odd panel counts, row tiles of 8 / 4 / 2 / 1), gives the
same bits on AVX2 and AVX-512 and for a row alone or in any batch, and refuses bad input; the
decode attention kernel equals per-sequence SDPA, and the runner hands it the decode spans."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.worker.engine import cpu_kernels as kernel

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


def _sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], lens: list[int]
) -> torch.Tensor:
    import torch.nn.functional as F

    outs = [
        F.scaled_dot_product_attention(
            q[b : b + 1], k[None, :, s : s + n], v[None, :, s : s + n], scale=0.125
        )
        for b, (s, n) in enumerate(zip(starts, lens, strict=True))
    ]
    return torch.cat(outs)


@pytest.mark.parametrize("rep", [1, 3])
def test_decode_attention_matches_sdpa_per_sequence(rep: int) -> None:
    # sequences of very different lengths (1 token .. 1,000) at scattered slots of one pool
    torch.manual_seed(rep)
    heads, dim, slots = 3, 64, 4096
    k, v = torch.randn(heads, slots, dim), torch.randn(heads, slots, dim)
    starts, lens = [0, 100, 1500, 2900, 4095], [1, 300, 17, 999, 1]
    q = torch.randn(len(starts), heads, rep, dim)
    want = _sdpa_reference(q, k, v, starts, lens)
    for isa in isas():
        got = kernel.decode_attention(q, k, v, torch.tensor(starts), torch.tensor(lens), 0.125, isa)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_slots_outside_the_pool() -> None:
    k = v = torch.randn(2, 64, 16)
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="out of the pool"):
        kernel.decode_attention(q, k, v, torch.tensor([60]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="out of the pool"):
        kernel.decode_attention(q, k, v, torch.tensor([0]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="one int64 start"):
        kernel.decode_attention(q, k, v, torch.tensor([0, 1]), torch.tensor([1, 1]), 1.0)


def test_runner_uses_the_kernel_for_decode_steps_and_matches_sdpa() -> None:
    """A PER_SEQ decode step on CPU: with every sequence's slots consecutive the runner hands the
    kernel their spans and attention equals the per-sequence SDPA path; a sequence with scattered
    blocks (or a step with a prefill chunk's rows) keeps SDPA for the decode sequences."""
    from types import SimpleNamespace

    from services.worker.engine.api import KvLayout, SamplingConfig
    from services.worker.engine.attention import AttentionBackend, paged_attention_forward
    from services.worker.engine.model_runner import ModelRunner, ScheduledSeq

    heads, kv_heads, dim, bs = 6, 2, 16, 4
    layout = KvLayout(num_layers=2, num_kv_heads=kv_heads, head_dim=dim, block_size=bs, dtype="float32")
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=heads))
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)

    def seq(start: int, first_block: int, blocks: int) -> ScheduledSeq:
        return ScheduledSeq([7], start, list(range(first_block, first_block + blocks)), True, greedy, None)

    consecutive = [seq(0, 0, 1), seq(9, 2, 3), seq(30, 6, 8), seq(3, 20, 1)]
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 2, kv_heads, 32 * bs, dim, generator=gen)
    q = torch.randn(1, heads, 4, dim, generator=gen)
    k = torch.randn(1, kv_heads, 4, dim, generator=gen)
    v = torch.randn(1, kv_heads, 4, dim, generator=gen)
    outs = []
    for use_kernel in (True, False):
        runner = ModelRunner(
            model,
            layout,
            32,
            CPU_DEVICE,
            torch.float32,
            AttentionBackend.PER_SEQ,
            cpu_attention_kernel=use_kernel,
        )
        runner.kv_cache.copy_(pool)
        _, _, meta, _ = runner._build_metadata(consecutive)
        assert (meta.decode_spans is not None) is use_kernel
        if use_kernel:
            assert meta.decode_spans is not None
            assert meta.decode_spans[0].tolist() == [0, 8, 24, 80]
            assert meta.decode_spans[1].tolist() == [1, 10, 31, 4]
        layer: Any = SimpleNamespace(layer_idx=1)  # only its layer index is read
        out, _ = paged_attention_forward(layer, q, k, v, None, scaling=dim**-0.5, paged_meta=meta)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    scattered = [*consecutive[:3], ScheduledSeq([7], 5, [30, 12], True, greedy, None)]
    runner = ModelRunner(model, layout, 32, CPU_DEVICE, torch.float32, AttentionBackend.PER_SEQ)
    assert runner._build_metadata(scattered)[2].decode_spans is None


CPU_DEVICE = torch.device("cpu")
