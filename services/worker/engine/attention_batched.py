"""The BATCHED attention backend (attention.py describes both backends): sequences with any query
lengths attended in one padded SDPA call per group and layer, keys and values gathered from the
pool by whole blocks, an additive mask built once per step (`build_batched_group`) hiding
padding, future positions and keys behind a layer's window. A group's index lists are built on
the host (`group_lists`) and reach the device in the step's one packed copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.sdpa import attend


@dataclass
class BatchedGroup:
    """Sequences attended in one padded call (BATCHED backend). B sequences, query rows padded
    to `q_max`, keys to `num_blocks_max * block_size`."""

    q_index: torch.Tensor | None  # [B * q_max] packed position of each query row (padding:
    # 0); None when the rows are the packed tokens themselves (a decode-only step)
    block_table: torch.Tensor  # [B * num_blocks_max] block ids (padding: block 0, masked)
    # [B, 1, q_max * rep, L] additive (0 / -inf), rows ordered (query, rep); None for a fresh
    # group (below), which attends causally without one
    mask: torch.Tensor | None
    out_rows: torch.Tensor | None  # [n] padded row (b * q_max + i) of each of its packed tokens
    out_positions: torch.Tensor | None  # [n] packed positions of its tokens (None: 0..T-1)
    num_seqs: int
    q_max: int
    num_blocks_max: int
    # the group is one sequence's first chunk (position 0 on) within the layer's window: it
    # attends causally to its own new K/V, read from the step's tensors, not gathered from the
    # pool, and builds no mask (a 2,048-token prompt of an 8B shape: 8 MiB per layer gathered
    # and a 32 MiB additive mask that keeps SDPA off its causal kernels), whether it is the
    # step's only group (one request's prefill) or shares the step with decode rows (a mixed
    # step: its packed rows are `span`)
    fresh: bool = False
    span: tuple[int, int] = (0, 0)  # a fresh group's packed rows [start, end)


def batched_attention(
    query: torch.Tensor,  # [1, heads, T, head_dim]
    layer_kv: torch.Tensor,  # [2, kv_heads, slots, head_dim]
    bs: int,  # block size (tokens)
    groups: list[BatchedGroup],
    scaling: float | None,
    softcap: float | None,
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]: the step's K/V (what a fresh group reads)
    value: torch.Tensor,
) -> torch.Tensor:
    """Every group's padded call; -> [1, T, heads, head_dim] in packed order."""
    if len(groups) == 1 and groups[0].fresh and groups[0].out_positions is None:
        return attend(query, key, value, scaling, softcap, is_causal=True).transpose(1, 2)
    _, num_heads, num_tokens, head_dim = query.shape
    kv_heads = layer_kv.shape[1]
    if len(groups) == 1 and groups[0].out_positions is None:
        return group_attention(query[0], layer_kv, bs, groups[0], kv_heads, scaling, softcap).unsqueeze(0)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    for g in groups:
        if g.fresh:  # causal over its own K/V, its rows contiguous
            s, e = g.span
            o = attend(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling, softcap, is_causal=True)
            out[s:e] = o[0].transpose(0, 1)
            continue
        assert g.out_positions is not None
        out.index_copy_(
            0, g.out_positions, group_attention(query[0], layer_kv, bs, g, kv_heads, scaling, softcap)
        )
    return out.unsqueeze(0)


def group_attention(
    query: torch.Tensor,
    layer_kv: torch.Tensor,
    block_size: int,
    g: BatchedGroup,
    kv_heads: int,
    scaling: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [heads, T, D] -> [n, heads, D] for the group's packed tokens (in packed order)."""
    assert g.mask is not None, "a fresh group attends in batched_attention, over the step's K/V"
    num_heads, _, head_dim = query.shape
    rep = num_heads // kv_heads
    b, q_max = g.num_seqs, g.q_max
    # queries [B, kv_heads, q_max * rep, D]; row (i, r) is query token i of head kv * rep + r
    q = query if g.q_index is None else query.index_select(1, g.q_index)
    q = q.reshape(kv_heads, rep, b, q_max, head_dim).permute(2, 0, 3, 1, 4)
    q = q.reshape(b, kv_heads, q_max * rep, head_dim)
    # keys/values of whole blocks: [2, kv_heads, B * num_blocks_max, block_size, D]
    _, _, slots, _ = layer_kv.shape
    kv = layer_kv.view(2, kv_heads, slots // block_size, block_size, head_dim)
    kv = kv.index_select(2, g.block_table)
    kv = kv.view(2, kv_heads, b, g.num_blocks_max * block_size, head_dim).transpose(1, 2)
    o = attend(q, kv[0], kv[1], scaling, softcap, mask=g.mask)
    # [B, kv_heads, q_max, rep, D] -> [B * q_max, heads, D]
    o = o.view(b, kv_heads, q_max, rep, head_dim).transpose(1, 2).reshape(b * q_max, num_heads, head_dim)
    return o if g.out_rows is None else o.index_select(0, g.out_rows)


@dataclass
class GroupLists:
    """A group's host-side index lists (`group_lists`), turned into device tensors by the caller
    in the step's one packed copy (step_inputs.py), then into a BatchedGroup per attention
    window (`build_batched_group`)."""

    starts: list[int]  # [B] each sequence's first query position
    q_index: list[int]  # [B * q_max] packed position of each query row (padding: 0)
    table: list[int]  # [B * num_blocks_max] block ids (padding: block 0)
    rows: list[int]  # [n] padded row of each packed token
    positions: list[int]  # [n] packed positions of the group's tokens
    num_seqs: int
    q_max: int
    num_blocks_max: int
    block_size: int  # tokens per block
    covers_all: bool  # the group holds every packed token, in this order

    def parts(self) -> tuple[list[int], ...]:
        """The lists in the order `build_batched_group` takes their tensors."""
        return self.starts, self.q_index, self.table, self.rows, self.positions


def group_lists(seqs: list[tuple[int, int, int, list[int]]], block_size: int, covers_all: bool) -> GroupLists:
    """One group's index lists from (q_start, q_len, start_pos, block_ids) per sequence,
    block_ids covering start_pos + q_len tokens."""
    b = len(seqs)
    q_max = max(n for _, n, _, _ in seqs)
    nb_max = max(-(-(start + n) // block_size) for _, n, start, _ in seqs)
    q_index: list[int] = []
    table: list[int] = []
    rows: list[int] = []
    positions: list[int] = []
    for i, (q_start, n, start, blocks) in enumerate(seqs):
        q_index.extend(range(q_start, q_start + n))
        q_index.extend([0] * (q_max - n))
        nb = -(-(start + n) // block_size)
        table.extend(blocks[:nb])
        table.extend([0] * (nb_max - nb))
        rows.extend(range(i * q_max, i * q_max + n))
        positions.extend(range(q_start, q_start + n))
    starts = [start for _, _, start, _ in seqs]
    return GroupLists(starts, q_index, table, rows, positions, b, q_max, nb_max, block_size, covers_all)


def build_batched_group(
    lists: GroupLists,
    tensors: list[torch.Tensor],  # lists.parts() on the device, in that order
    q_per_kv: int,
    dtype: torch.dtype,
    window: int | None = None,
) -> BatchedGroup:
    """The group's call for layers with `window` (None: full attention): the additive mask
    (none for a fresh group), built on the device from the sequences' start positions (no host
    list is copied here: on CUDA a copy from pageable memory waits for every queued kernel)."""
    starts, q_index, table, rows, positions = tensors
    q_max, nb_max = lists.q_max, lists.num_blocks_max
    fresh = lists.num_seqs == 1 and lists.starts[0] == 0 and q_max > 1 and (window is None or q_max <= window)
    mask = None if fresh else _mask(starts, q_max, nb_max * lists.block_size, q_per_kv, dtype, window)
    identity_rows = lists.covers_all and q_max == 1
    return BatchedGroup(
        q_index=None if identity_rows else q_index,
        block_table=table,
        mask=mask,
        out_rows=None if identity_rows else rows,
        out_positions=None if lists.covers_all else positions,
        num_seqs=lists.num_seqs,
        q_max=q_max,
        num_blocks_max=nb_max,
        fresh=fresh,
        span=(lists.positions[0], lists.positions[-1] + 1) if fresh else (0, 0),
    )


def _mask(
    starts: torch.Tensor,  # [B] each sequence's first query position
    q_max: int,
    keys: int,
    q_per_kv: int,
    dtype: torch.dtype,
    window: int | None,
) -> torch.Tensor:
    """The group's additive mask [B, 1, q_max * rep, keys], built on the device."""
    device = starts.device
    # query row i of sequence b (position start_b + i) sees keys 0..start_b + i; padding rows
    # (i >= q_len) see a few finite keys too (never all -inf: no NaN) and are dropped
    q_pos = starts[:, None] + torch.arange(q_max, device=device)[None, :]  # [B, q_max]
    key_pos = torch.arange(keys, device=device)[None, None, :]
    visible = key_pos <= q_pos[:, :, None]
    if window is not None:  # and within the window (a padding row still sees its own position)
        visible &= key_pos > q_pos[:, :, None] - window
    if q_max > 1 and q_per_kv > 1:
        visible = visible.repeat_interleave(q_per_kv, dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask.unsqueeze(1)
