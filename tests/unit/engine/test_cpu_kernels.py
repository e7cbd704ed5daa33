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
            for prefetch in (False, True):
                got = kernel.panel_mm(x, panels, isa, prefetch)
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
        for prefetch in (None, False, True):  # asking for the next panels early changes no bit
            assert torch.equal(kernel.panel_mm(x, panels, isa, prefetch), full)
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
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        kernel.panel_mm(torch.randn(65, 8), panels)
    # layouts it does not take: no panels at all
    assert kernel.panels_of(torch.randn(40, 8)) is None  # 40 features: not whole panels
    assert kernel.panels_of(torch.randn(32, 8, dtype=torch.bfloat16)) is None


def test_panels_written_into_a_slice_of_a_shared_buffer() -> None:
    """panels_of(w, into): the same panels as new memory, in the slice given (no copy after)."""
    w1, w2 = torch.randn(32, 24), torch.randn(48, 24)
    buf = kernel.empty_on_huge_pages((32 * 24 + 48 * 24,), torch.float32)
    p1 = kernel.panels_of(w1, buf[: 32 * 24])
    p2 = kernel.panels_of(w2, buf[32 * 24 :])
    assert p1 is not None and p2 is not None
    fresh1, fresh2 = kernel.panels_of(w1), kernel.panels_of(w2)
    assert fresh1 is not None and fresh2 is not None
    assert torch.equal(p1, fresh1) and torch.equal(p2, fresh2)
    assert p1.data_ptr() == buf.data_ptr() and p2.data_ptr() == buf.data_ptr() + 32 * 24 * 4
    x = torch.randn(3, 24)
    torch.testing.assert_close(kernel.panel_mm(x, p2), x @ w2.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3, 5), torch.float32), ((1 << 20,), torch.bfloat16), ((0,), torch.float32)]
)
def test_huge_page_tensors_are_aligned_usable_and_outlive_the_name(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """empty_on_huge_pages: 2 MiB-aligned (what lets the OS back it with huge pages), the shape
    and dtype asked for, an ordinary tensor to torch, and kept alive by any view of it."""
    t = kernel.empty_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    t.fill_(3)
    t_numel = t.numel()
    view = t.view(-1)[1:]
    del t
    assert bool((view == 3).all())
    assert view.numel() == max(0, t_numel - 1)


def _sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[list[int]], lens: list[int], bs: int
) -> torch.Tensor:
    import torch.nn.functional as F

    outs = []
    for b, (table, n) in enumerate(zip(tables, lens, strict=True)):
        slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
        kb, vb = k[:, slots][None], v[:, slots][None]
        outs.append(F.scaled_dot_product_attention(q[b : b + 1], kb, vb, scale=0.125))
    return torch.cat(outs)


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


@pytest.mark.parametrize(("rep", "dim"), [(1, 64), (3, 64), (5, 128), (4, 48)])
@pytest.mark.parametrize("bs", [1, 16])
def test_decode_attention_matches_sdpa_per_sequence(rep: int, dim: int, bs: int) -> None:
    # sequences of very different lengths (1 token .. ~1,000) over consecutive, scattered and
    # shared (prefix-cache) blocks of one pool
    import random

    torch.manual_seed(rep)
    heads, blocks = 3, 4096 // bs
    k, v = torch.randn(heads, blocks * bs, dim), torch.randn(heads, blocks * bs, dim)
    rng = random.Random(bs)
    free = list(range(blocks))
    rng.shuffle(free)
    lens = [1, 300, 17, 999, 1, 40]
    nblocks = [-(-n // bs) for n in lens]
    tables = [
        list(range(0, nblocks[0])),
        list(range(100, 100 + nblocks[1])),  # consecutive
        [free.pop() for _ in range(nblocks[2])],  # scattered
        [free.pop() for _ in range(nblocks[3])],
        [free.pop()],
    ]
    tables.append([*tables[1][: nblocks[5] - 1], free.pop()])  # shares a prefix with sequence 1
    q = torch.randn(len(lens), heads, rep, dim)
    want = _sdpa_reference(q, k, v, tables, lens, bs)
    for isa in isas():
        got = kernel.decode_attention(q, k, v, _padded(tables), torch.tensor(lens), bs, 0.125, isa)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_decode_attention_from_first_keys_matches_sdpa_over_the_window(bs: int) -> None:
    """A sliding window: sequence b attends to its keys starts[b] .. lens[b] - 1 only; blocks
    wholly before its first key may even hold garbage (they are not read)."""
    import random

    torch.manual_seed(bs)
    heads, dim, rep, blocks = 2, 32, 3, 2048 // bs
    k, v = torch.randn(heads, blocks * bs, dim), torch.randn(heads, blocks * bs, dim)
    rng = random.Random(bs)
    free = list(range(1, blocks))
    rng.shuffle(free)
    lens = [1, 40, 17, 300, 9]
    starts = [0, 33, 0, 300 - 64, 8]
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    q = torch.randn(len(lens), heads, rep, dim)
    want = torch.cat(
        [
            _window_reference(q[b : b + 1], k, v, t, s, n, bs)
            for b, (t, s, n) in enumerate(zip(tables, starts, lens, strict=True))
        ]
    )
    # blocks wholly behind a window point at block 0, all NaN: reading one would show
    k[:, :bs] = v[:, :bs] = float("nan")
    for b, s in enumerate(starts):
        tables[b][: s // bs] = [0] * (s // bs)
    for isa in isas():
        got = kernel.decode_attention(
            q, k, v, _padded(tables), torch.tensor(lens), bs, 0.125, isa, starts=torch.tensor(starts)
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _window_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int], start: int, n: int, bs: int
) -> torch.Tensor:
    import torch.nn.functional as F

    slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(start, n)])
    return F.scaled_dot_product_attention(q, k[:, slots][None], v[:, slots][None], scale=0.125)


def test_decode_attention_refuses_slots_outside_the_pool() -> None:
    k = v = torch.randn(2, 64, 16)  # 16 blocks of 4 slots
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="out of the pool"):
        kernel.decode_attention(q, k, v, torch.tensor([[16, 0]]), torch.tensor([5]), 4, 1.0)
    with pytest.raises(RuntimeError, match="out of the pool"):  # more tokens than its table holds
        kernel.decode_attention(q, k, v, torch.tensor([[1, 2]]), torch.tensor([9]), 4, 1.0)
    with pytest.raises(RuntimeError, match="out of the pool"):
        kernel.decode_attention(q, k, v, torch.tensor([[0]]), torch.tensor([0]), 4, 1.0)
    with pytest.raises(RuntimeError, match="block-table row"):
        kernel.decode_attention(q, k, v, torch.tensor([[0], [1]]), torch.tensor([1, 1]), 4, 1.0)
    with pytest.raises(RuntimeError, match="first key outside"):  # a window must keep its query
        kernel.decode_attention(
            q, k, v, torch.tensor([[0, 1]]), torch.tensor([5]), 4, 1.0, starts=torch.tensor([5])
        )
    with pytest.raises(RuntimeError, match="first key per sequence"):
        kernel.decode_attention(
            q, k, v, torch.tensor([[0, 1]]), torch.tensor([5]), 4, 1.0, starts=torch.tensor([1, 2])
        )


def test_runner_uses_the_kernel_for_decode_steps_and_matches_sdpa() -> None:
    """A PER_SEQ decode step on CPU: the runner hands the kernel every decoding sequence's block
    table (consecutive or scattered) and attention equals the per-sequence SDPA path;
    --no-cpu-attention-kernel keeps SDPA."""
    from types import SimpleNamespace

    from services.worker.engine.api import KvLayout, SamplingConfig
    from services.worker.engine.attention import AttentionBackend, paged_attention_forward
    from services.worker.engine.backend import ModelBackend
    from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
    from services.worker.engine.options import BackendOptions

    heads, kv_heads, dim, bs = 6, 2, 16, 4
    layout = KvLayout(num_layers=2, num_kv_heads=kv_heads, head_dim=dim, block_size=bs, dtype="float32")
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=heads))
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)

    def seq(start: int, blocks: list[int]) -> ScheduledSeq:
        return ScheduledSeq([7], start, blocks, True, greedy, None)

    step = [seq(0, [0]), seq(9, [2, 3, 4]), seq(30, list(range(6, 14))), seq(5, [30, 12])]
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
            backend=ModelBackend.choose(BackendOptions(cpu_attention_kernel=use_kernel), CPU_DEVICE),
        )
        runner.kv_cache.copy_(pool)
        _, _, meta, _ = runner._build_metadata(step)
        assert (meta.decode_spans is not None) is use_kernel
        if meta.decode_spans is not None:
            tables, lens = meta.decode_spans
            assert lens.tolist() == [1, 10, 31, 6]
            assert tables[1].tolist()[:3] == [2, 3, 4] and tables[3].tolist()[:2] == [30, 12]
        layer: Any = SimpleNamespace(layer_idx=1)  # only its layer index is read
        out, _ = paged_attention_forward(layer, q, k, v, None, scaling=dim**-0.5, paged_meta=meta)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


CPU_DEVICE = torch.device("cpu")


def test_the_kernels_build_with_warnings_as_errors() -> None:
    """csrc/cpu_kernels.cpp compiles with -Wall -Wextra -Werror on this (CI's) compiler: the
    JIT build fell back to a lenient build only where a compiler warns (logged), never here."""
    if not kernel.available():
        pytest.skip("the CPU kernels cannot be built here")
    assert kernel.built_strict() is not False
