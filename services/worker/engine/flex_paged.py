"""Attention over the paged KV pool in place, with torch's FlexAttention (issue 31, item 1).

Owns `FlexPagedStep`: the static buffers of one decode/verify bucket (B sequences x Q query rows,
block tables W blocks wide) and the FlexAttention call that reads every sequence's K/V straight
from the pool through its block table, for one layer at a time.

How the pool becomes FlexAttention's input: each layer's K (and V) is viewed as one sequence of
every slot, [1, kv_heads, slots, D] (a view, no copy), shared by the B query sequences (FlexAttention
broadcasts a key batch of 1). The block mask's KV block size is the pool's block size, so a
sequence's block table *is* its list of KV blocks to visit (`kv_indices`), and `kv_num_blocks`
says how many: the kernel reads only the blocks a sequence owns, and the context length never
changes a tensor's shape (one CUDA graph per batch size). The mask function is exact on its own
(FlexAttention's reference implementation applies it to every slot): each step first turns the
block tables into a physical-to-logical block map on the device ([B, blocks], -1 where a block is
not the sequence's), and a key is visible to a row while its logical position is below the row's
context length. Padding sequences own the scratch block and see nothing of a request's KV.

Why FlexAttention (measured on one H200, benchmarks/cuda_attention.py, results in
benchmarks/results/cuda-attention-h200.json): the gather of whole blocks into a padded buffer +
SDPA that the BATCHED backend does reads and writes the KV twice more and pads every sequence to
its bucket; FlashInfer's wheel JIT-compiles its kernels with nvcc at first use (minutes) or
needs a 458 MB precompiled wheel, and FlashAttention has no binary wheel; FlexAttention is in
torch, generates its decode kernel with Triton (split over the KV length) and compiles in
seconds. CUDA only: elsewhere `available()` is False and the engine keeps the BATCHED / PER_SEQ
backends of attention.py (the torch-only fallback, logged once).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.engine.pinned import Staging

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """FlexAttention with a GPU compiler: CUDA and Triton present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        log.warning("FlexAttention unavailable (%s): CUDA attention gathers KV (BATCHED backend)", exc)
        return False
    return True


# The smallest pool block (tokens) FlexAttention in place compiles for on a GPU: the block mask's
# KV block is the pool's block, the Triton kernel's KV tile is at most that block, and Triton's
# matrix products need tiles of at least 16 along every dimension (blocks of 4 tokens failed on
# an H200, 2026-11-27: the worker tests used --block-size 4).
MIN_GPU_BLOCK_SIZE = 16


def fits_block_size(block_size: int, device: torch.device) -> bool:
    """Whether attention in place can read a pool of `block_size`-token blocks on `device`
    (anywhere but CUDA FlexAttention runs its reference implementation: any size). Logs once
    per size when it cannot: the rank then runs the torch-only path."""
    if device.type != "cuda" or block_size % MIN_GPU_BLOCK_SIZE == 0:
        return True
    _warn_block_size(block_size)
    return False


@functools.cache
def _warn_block_size(block_size: int) -> None:
    log.warning(
        "--block-size %d: attention in place needs blocks of a multiple of %d tokens on a GPU; "
        "this rank gathers KV (the torch-only path), slower per step",
        block_size,
        MIN_GPU_BLOCK_SIZE,
    )


# FlexAttention compiles once per bucket shape (batch buckets 1..64 x 1 or k + 1 rows, a draft
# model's too); dynamo's default of 8 compilations per function failed a speculative worker at
# start on an H200 ("recompile limit exceeded" with fullgraph). Every bucket compiles once, at
# start, so the bound only has to cover them.
_RECOMPILE_LIMIT = 128


def allow_compilations() -> None:
    """Raise dynamo's per-function compilation bound to cover every bucket (process-wide; a
    worker process owns its dynamo state)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, 4 * _RECOMPILE_LIMIT
    )


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    allow_compilations()
    # fullgraph: the call is one kernel (or two: split-KV partials + their reduction), no Python
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


@dataclass
class FlexPagedStep:
    """Static buffers of one bucket; the step fills them in place (a CUDA graph reads them)."""

    num_seqs: int  # B
    q_rows: int  # Q query rows per sequence
    width: int  # W blocks per block table
    block_size: int
    kv_num_blocks: torch.Tensor  # [B, 1, 1] int32: blocks each sequence owns
    kv_indices: torch.Tensor  # [B, 1, 1, W] int32: its block table (padding: the scratch block)
    ctx_lens: torch.Tensor  # [B, Q] int32: keys row q sees (= its position + 1)
    logical: torch.Tensor  # [B, pool blocks] int32: a block's index in the sequence's table, or -1
    # FlexAttention's BlockMask over these buffers, per attention window (None: full attention)
    block_masks: dict[int | None, Any]
    compiled: bool  # the Triton kernel (CUDA); False: FlexAttention's reference (any device)
    packed: torch.Tensor  # kv_num_blocks, kv_indices and ctx_lens as one flat tensor (views)
    staging: Staging  # its host side (pinned on CUDA)

    @staticmethod
    def new(
        num_seqs: int,
        q_rows: int,
        width: int,
        block_size: int,
        num_pool_blocks: int,
        scratch_block: int,
        device: Any,
        compiled: bool = True,
        windows: tuple[int, ...] = (),
    ) -> FlexPagedStep:
        """windows: the sliding windows (tokens) some layers attend with
        (model_variants.attention_windows); each gets its own mask over the same buffers: a row at
        position p sees keys p - window + 1 .. p."""
        from torch.nn.attention.flex_attention import BlockMask

        b, bs = num_seqs, block_size
        # the host-filled buffers are views of one int32 tensor (one copy per step, pinned.py):
        # kv_num_blocks [B], kv_indices [B * W], ctx_lens [B * Q], each starting 16-byte aligned
        # (the compiled kernel may assume aligned inputs)
        at_idx, at_ctx = _segment(b), _segment(b) + _segment(b * width)
        packed = torch.empty(at_ctx + b * q_rows, dtype=torch.int32, device=device)
        kv_num_blocks = packed[:b].fill_(1).view(b, 1, 1)
        kv_indices = packed[at_idx : at_idx + b * width].fill_(scratch_block).view(b, 1, 1, width)
        ctx_lens = packed[at_ctx:].fill_(1).view(b, q_rows)
        logical = torch.full((b, num_pool_blocks), -1, dtype=torch.int32, device=device)

        def mask_for(window: int | None) -> Any:
            def mask_mod(bi: Any, _h: Any, q_idx: Any, kv_idx: Any) -> Any:
                index = logical[bi, kv_idx // bs]
                position = index * bs + kv_idx % bs
                visible = (index >= 0) & (position < ctx_lens[bi, q_idx])
                if window is None:
                    return visible
                return visible & (position >= ctx_lens[bi, q_idx] - window)

            return BlockMask.from_kv_blocks(
                kv_num_blocks,
                kv_indices,
                BLOCK_SIZE=(128, bs),
                mask_mod=mask_mod,
                seq_lengths=(q_rows, num_pool_blocks * bs),
                compute_q_blocks=False,
            )

        masks = {w: mask_for(w) for w in (None, *windows)}
        return FlexPagedStep(
            b,
            q_rows,
            width,
            bs,
            kv_num_blocks,
            kv_indices,
            ctx_lens,
            logical,
            masks,
            compiled,
            packed,
            Staging(packed.numel(), torch.int32, torch.device(device)),
        )

    def fill(
        self, tables: Sequence[Sequence[int]], ctx_lens: Sequence[Sequence[int]], scratch_block: int
    ) -> None:
        """Host values of a step: per real sequence its block table (covering its longest row)
        and each row's context length (Q values; padding rows 1). Sequences past len(tables)
        are padding."""
        b, w, q = self.num_seqs, self.width, self.q_rows
        at_idx, at_ctx = _segment(b), _segment(b) + _segment(b * w)
        arr = self.staging.acquire(self.packed.numel())
        nums, idx, ctx = arr[:b], arr[at_idx : at_idx + b * w], arr[at_ctx:]
        nums[:] = 1
        idx[:] = scratch_block
        ctx[:] = 1
        windowed = len(self.block_masks) > 1
        for i, (table, lens) in enumerate(zip(tables, ctx_lens, strict=True)):
            if windowed and len(set(table)) != len(table):
                table = _drop_stale(table, scratch_block)
            n = len(table)
            if n > w:
                raise ValueError(f"a block table of {n} blocks exceeds the bucket's {w}")
            nums[i] = n
            idx[i * w : i * w + n] = table
            ctx[i * q : (i + 1) * q] = lens
        self.staging.copy_to(self.packed, self.packed.numel())

    def prepare(self) -> None:
        """Device-side, once per step before the layers (capturable): the physical-to-logical
        map from the block tables. Table entries past a sequence's blocks (the scratch block)
        get indices >= its block count, whose positions no row sees."""
        w = self.width
        self.logical.fill_(-1)
        table = self.kv_indices.view(self.num_seqs, w).long()
        order = torch.arange(w, dtype=torch.int32, device=table.device).expand(self.num_seqs, w)
        self.logical.scatter_(1, table, order)

    def attend(
        self,
        q: torch.Tensor,  # [B * Q, heads, D], row b * Q + i = query i of sequence b
        k_pool: torch.Tensor,  # [kv_heads, slots, D] one layer's K (the pool, in place)
        v_pool: torch.Tensor,
        scale: float,
        window: int | None = None,  # the layer's sliding window (tokens); None: full attention
    ) -> torch.Tensor:
        """-> [B * Q, heads, D]."""
        from torch.nn.attention.flex_attention import flex_attention

        rows, heads, dim = q.shape
        query = q.view(self.num_seqs, self.q_rows, heads, dim).transpose(1, 2)  # [B, H, Q, D]
        fn = _compiled_flex() if self.compiled else flex_attention
        out = fn(
            query,
            k_pool.unsqueeze(0),
            v_pool.unsqueeze(0),
            block_mask=self.block_masks[window],
            scale=scale,
            enable_gqa=heads != k_pool.shape[0],
        )
        return out.transpose(1, 2).reshape(rows, heads, dim)


def _segment(n: int) -> int:
    """Elements (int32) from one packed buffer's start to the next one's: 16-byte aligned."""
    return -(-n // 4) * 4


def _drop_stale(table: Sequence[int], scratch_block: int) -> list[int]:
    """A windowed request's table may still list blocks it gave back (behind every window,
    Scheduler.kv_window_tokens), and one of them may since have come back to it further on: the
    physical-to-logical map must see only the later place, so earlier repeats become the scratch
    block (masked: behind the window)."""
    seen: set[int] = set()
    out: list[int] = []
    for block in reversed(table):
        out.append(scratch_block if block in seen else block)
        seen.add(block)
    return out[::-1]
