"""Attention over the paged pool in place (engine/flex_paged.py), with FlexAttention's reference
implementation on CPU (the compiled kernel runs the same mask on CUDA: gpu tests): every
sequence's rows see exactly their own blocks, in table order, up to their context length, for
decode steps (1 row) and verify steps (several rows ending in the last two blocks), with
scattered block tables, and padding sequences stay finite."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.flex_paged import FlexPagedStep, fits_block_size

BS = 16
POOL_BLOCKS = 40
SCRATCH = POOL_BLOCKS  # the block no request owns
HEADS, KV_HEADS, DIM = 8, 2, 32


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """One query row [heads, D] over keys first..end-1 of [kv_heads, n, D], GQA by folding the
    query heads of a KV head into rows -> [heads, D]."""
    rows = q.view(KV_HEADS, HEADS // KV_HEADS, DIM)
    out = F.scaled_dot_product_attention(rows, k[:, first:end], v[:, first:end], scale=DIM**-0.5)
    return out.reshape(HEADS, DIM)


def _slots(table: list[int], n: int) -> torch.Tensor:
    return torch.cat([torch.arange(x * BS, (x + 1) * BS) for x in table])[:n]


@pytest.mark.parametrize(
    ("batch", "rows", "contexts"),
    [
        (4, 1, [1, 17, 33, 100]),  # decode: one row, contexts ending anywhere in a block
        (4, 1, [16, 32, 5]),  # one padding sequence
        (2, 4, [20, 35]),  # verify: 4 rows spanning a block boundary
        (3, 6, [6, 17, 64]),
    ],
)
def test_rows_see_their_own_blocks_up_to_their_context(batch: int, rows: int, contexts: list[int]) -> None:
    torch.manual_seed(0)
    rng = random.Random(batch * 100 + rows)
    pool = torch.randn(2, KV_HEADS, (POOL_BLOCKS + 1) * BS, DIM)
    step = FlexPagedStep.new(batch, rows, 16, BS, POOL_BLOCKS + 1, SCRATCH, "cpu", compiled=False)
    free = list(range(POOL_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in contexts]
    ctx = [[n - rows + i + 1 for i in range(rows)] for n in contexts]
    step.fill(tables, ctx, SCRATCH)
    step.prepare()
    q = torch.randn(batch * rows, HEADS, DIM)
    out = step.attend(q, pool[0], pool[1], DIM**-0.5)
    assert torch.isfinite(out).all()
    for b, (table, n) in enumerate(zip(tables, contexts, strict=True)):
        k, v = pool[0][:, _slots(table, n)], pool[1][:, _slots(table, n)]
        for i in range(rows):
            want = _reference(q[b * rows + i], k, v, 0, ctx[b][i])
            torch.testing.assert_close(out[b * rows + i], want, rtol=1e-5, atol=1e-5)


def test_a_step_reuses_the_buffers_and_forgets_the_last_step() -> None:
    """The physical-to-logical map is rebuilt each step: a block a sequence owned last step is
    invisible to it now, and a longer table than the bucket's width is refused."""
    torch.manual_seed(1)
    pool = torch.randn(2, KV_HEADS, (POOL_BLOCKS + 1) * BS, DIM)
    step = FlexPagedStep.new(1, 1, 4, BS, POOL_BLOCKS + 1, SCRATCH, "cpu", compiled=False)
    q = torch.randn(1, HEADS, DIM)
    step.fill([[3, 7]], [[20]], SCRATCH)
    step.prepare()
    first = step.attend(q, pool[0], pool[1], 1.0)
    step.fill([[7]], [[10]], SCRATCH)
    step.prepare()
    second = step.attend(q, pool[0], pool[1], 1.0)
    k, v = pool[0][:, 7 * BS : 7 * BS + 10], pool[1][:, 7 * BS : 7 * BS + 10]
    want = F.scaled_dot_product_attention(q.view(KV_HEADS, -1, DIM), k, v, scale=1.0).reshape(1, HEADS, DIM)
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, second)
    assert int(step.logical[0, 3]) == -1 and int(step.logical[0, 7]) == 0
    with pytest.raises(ValueError, match="exceeds the bucket's 4"):
        step.fill([[1, 2, 3, 4, 5]], [[70]], SCRATCH)


@pytest.mark.parametrize("window", [4, 16, 21])
def test_a_windowed_layer_sees_only_its_window(window: int) -> None:
    """A layer with a sliding window: a row at position p sees keys p - window + 1 .. p, from the
    same buffers as the full layers; a table that lists a block twice (one given back behind the
    window and handed to the request again further on) counts only its later place."""
    torch.manual_seed(2)
    pool = torch.randn(2, KV_HEADS, (POOL_BLOCKS + 1) * BS, DIM)
    rows = 3
    step = FlexPagedStep.new(
        2, rows, 8, BS, POOL_BLOCKS + 1, SCRATCH, "cpu", compiled=False, windows=(window,)
    )
    tables = [[5, 9, 5, 12], [20, 21, 22]]  # block 5 given back at position 0, reused at 2
    contexts = [60, 40]
    ctx = [[n - rows + i + 1 for i in range(rows)] for n in contexts]
    step.fill(tables, ctx, SCRATCH)
    step.prepare()
    q = torch.randn(2 * rows, HEADS, DIM)
    full = step.attend(q, pool[0], pool[1], DIM**-0.5)
    windowed = step.attend(q, pool[0], pool[1], DIM**-0.5, window)
    for b, (table, n) in enumerate(zip(tables, contexts, strict=True)):
        k, v = pool[0][:, _slots(table, n)], pool[1][:, _slots(table, n)]
        for i in range(rows):
            c = ctx[b][i]
            want = _reference(q[b * rows + i], k, v, max(0, c - window), c)
            torch.testing.assert_close(windowed[b * rows + i], want, rtol=1e-5, atol=1e-5)
            if b == 1:  # no repeated block: the full layer sees everything up to its context
                want = _reference(q[b * rows + i], k, v, 0, c)
                torch.testing.assert_close(full[b * rows + i], want, rtol=1e-5, atol=1e-5)


def test_attention_in_place_needs_blocks_of_16_tokens_on_a_gpu(caplog: pytest.LogCaptureFixture) -> None:
    """Triton's tiles are at least 16 wide and the KV tile is at most a pool block: a GPU rank
    with smaller blocks runs the torch-only path (ModelRunner.fused) and says so once; on CPU
    FlexAttention's reference implementation takes any block."""
    cuda = torch.device("cuda")  # a device object: no GPU needed
    assert fits_block_size(16, cuda) and fits_block_size(32, cuda)
    assert not fits_block_size(4, cuda) and not fits_block_size(8, cuda)
    with caplog.at_level("WARNING"):
        assert not fits_block_size(24, cuda) and not fits_block_size(24, cuda)
    assert sum("--block-size 24:" in r.getMessage() for r in caplog.records) == 1
    assert fits_block_size(4, torch.device("cpu")) and fits_block_size(8, torch.device("cpu"))
