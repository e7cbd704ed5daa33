"""A packed step's inputs from its scheduled sequences: input_ids and positions [1, T] (no
padding), the slot of every new token, the rows whose logits are sampled, and the attention
metadata of the runner's backend (attention.py): PER_SEQ (single-token sequences first, their
block tables for the CPU decode kernel, zero-copy views of consecutive blocks) or BATCHED (short
queries and long chunks in two padded groups), with a variant per attention window the step
reaches past."""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.worker.engine import attention, attention_batched
from services.worker.engine.attention import AttentionBackend
from services.worker.engine.decode_graphs import DecodeSeq

if TYPE_CHECKING:
    from services.worker.engine.lora import LoraStep
    from services.worker.engine.model_runner import ModelRunner, ScheduledSeq

# BATCHED backend: sequences with at most this many new tokens (decode, speculative verify,
# short chunks) share one padded call; longer prefill chunks share a second one, so a decode
# row is never padded to a prefill chunk's length.
_SHORT_QUERY = 32


def build(
    runner: ModelRunner, seqs: list[ScheduledSeq]
) -> tuple[torch.Tensor, torch.Tensor, attention.PagedAttentionMetadata, torch.Tensor]:
    """input_ids [1, T], position_ids [1, T], the attention metadata of the runner's backend,
    and the packed rows whose logits are sampled (in the order of the sampling sequences)."""
    if runner.attention_backend is AttentionBackend.BATCHED:
        return _build_batched(runner, seqs)
    bs = runner.layout.block_size
    dev = runner.device
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    attn: list[attention.SeqAttention] = []
    # single-token sequences first: attention batches their bookkeeping
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
    decode_idx: list[int] = []
    decode_tables: list[list[int]] = []  # block ids of each single-token sequence
    # the CPU decode kernel reads the single-token sequences' KV through `spans` (below): their
    # SeqAttention then has neither kv_start nor blocks (nothing else reads them)
    kernel = runner.cpu_attention_kernel
    for i in order:
        s = seqs[i]
        q_start = len(input_ids)
        n = len(s.token_ids)
        start = s.start_pos
        if n == 1:  # a decode token: the same as the general case below, without its loops
            input_ids.append(s.token_ids[0])
            positions.append(start)
            blocks = s.block_ids[: start // bs + 1]
            slots.append(blocks[-1] * bs + start % bs)
            decode_idx.append(q_start)
            decode_tables.append(blocks)
            if kernel:
                attn.append(_seq_attention(q_start, 1, start, None, None, None, dev))
                continue
        else:
            ctx = start + n
            input_ids.extend(s.token_ids)
            pos = range(start, ctx)
            positions.extend(pos)
            blocks = s.block_ids[: -(-ctx // bs)]
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
        kv_start: int | None = None
        block_tensor: torch.Tensor | None = None
        if start != 0 or n == 1:
            if blocks[-1] - blocks[0] == len(blocks) - 1 and _consecutive(blocks):
                kv_start = blocks[0] * bs
            else:
                block_tensor = torch.tensor(blocks, device=dev)
        attn.append(_seq_attention(q_start, n, start, kv_start, block_tensor, None, dev))
    # logits rows in the caller's order of the sampling sequences
    first_pos = {i: a.q_start + a.q_len - 1 for i, a in zip(order, attn, strict=True)}
    logits_idx = [first_pos[i] for i, s in enumerate(seqs) if s.sample or s.prompt_targets]
    parts = [input_ids, positions, slots, logits_idx, decode_idx]
    width = 0
    if kernel and decode_idx:
        # the decode sequences' block tables (padded with 0) and context lengths, packed with
        # the index lists (the kernel runs only on CPU, where the pack is a host tensor)
        width = max(len(t) for t in decode_tables)
        tables: list[int] = []
        pad = [0] * width
        for t in decode_tables:
            tables += t
            tables += pad[len(t) :]
        parts += [tables, [a.ctx_len for a in attn[: len(decode_idx)]]]
    ids_t, pos_t, slots_t, logits_t, decode_t, *span_parts = _index_tensors(runner, parts)
    spans = None
    if span_parts:
        spans = (span_parts[0].view(len(decode_tables), width), span_parts[1])
    meta = attention.PagedAttentionMetadata(
        kv_cache=runner.kv_cache,
        block_size=bs,
        slots=slots_t,
        seqs=attn,
        decode_idx=decode_t if decode_idx else None,
        num_decode=len(decode_idx),
        decode_spans=spans,
        layer_windows=runner.layer_windows,
        lora=_lora_step(runner, seqs, order),
    )
    max_ctx = max(a.ctx_len for a in attn) if runner.layer_windows else 0
    for window in sorted({w for w in runner.layer_windows if w is not None}):
        if max_ctx <= window:  # no query of the step reaches past the window
            meta.windowed[window] = meta
            continue
        w_attn = [
            _seq_attention(a.q_start, a.q_len, a.ctx_len - a.q_len, a.kv_start, a.blocks, window, dev)
            for a in attn
        ]
        starts = None
        if spans is not None:
            starts = torch.tensor([a.first_key for a in w_attn[: len(decode_idx)]], dtype=torch.int64)
        meta.windowed[window] = dataclasses.replace(meta, seqs=w_attn, decode_starts=starts, windowed={})
    return ids_t[None], pos_t[None], meta, logits_t


def _build_batched(
    runner: ModelRunner, seqs: list[ScheduledSeq]
) -> tuple[torch.Tensor, torch.Tensor, attention.PagedAttentionMetadata, torch.Tensor]:
    bs = runner.layout.block_size
    # short queries first, then long chunks; each part is one attention call per layer
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) > _SHORT_QUERY)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    parts: tuple[list[tuple[int, int, int, list[int]]], ...] = ([], [])
    last_pos: dict[int, int] = {}
    for i in order:
        s = seqs[i]
        q_start = len(input_ids)
        n = len(s.token_ids)
        input_ids.extend(s.token_ids)
        pos = range(s.start_pos, s.start_pos + n)
        positions.extend(pos)
        blocks = s.block_ids
        slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
        parts[n > _SHORT_QUERY].append((q_start, n, s.start_pos, blocks))
        last_pos[i] = q_start + n - 1
    flex_short = None
    graphs = runner.graphs
    lora = _lora_step(runner, seqs, order)
    if (
        lora is None  # a LoRA step runs the unfused layers, which read no in-place decode rows
        and graphs is not None
        and graphs.flex_blocks
        and parts[0]
        and parts[1]
        and all(n == 1 for _, n, _, _ in parts[0])
    ):
        # a mixed step on CUDA: its decode rows (packed first) attend in place (FlexAttention
        # over a decode bucket's block tables), its prompt chunks in the groups
        decode = [DecodeSeq((0,), start, blocks) for _, _, start, blocks in parts[0]]
        flex_short = (graphs.flex_rows(decode), len(decode))
        parts = ([], parts[1])
    nonempty = [p for p in parts if p]
    lists = [
        attention_batched.group_lists(p, bs, covers_all=len(nonempty) == 1 and flex_short is None)
        for p in nonempty
    ]
    logits_idx = [last_pos[i] for i, s in enumerate(seqs) if s.sample or s.prompt_targets]
    # every index list of the step, the groups' too, in one copy (pinned staging on CUDA)
    group_parts = [g.parts() for g in lists]
    tensors = _index_tensors(
        runner, [input_ids, positions, slots, logits_idx, *(x for p in group_parts for x in p)]
    )
    ids_t, pos_t, slots_t, logits_t = tensors[:4]
    per_group, at = [], 4
    for p in group_parts:
        per_group.append(tensors[at : at + len(p)])
        at += len(p)

    def groups_for(window: int | None) -> list[attention_batched.BatchedGroup]:
        return [
            attention_batched.build_batched_group(g, t, runner.q_per_kv, runner.dtype, window=window)
            for g, t in zip(lists, per_group, strict=True)
        ]

    meta = attention.PagedAttentionMetadata(
        kv_cache=runner.kv_cache,
        block_size=bs,
        slots=slots_t,
        seqs=[],
        decode_idx=None,
        num_decode=0,
        groups=groups_for(None),
        layer_windows=runner.layer_windows,
        flex_short=flex_short,
        lora=lora,
    )
    max_ctx = max(s.start_pos + len(s.token_ids) for s in seqs) if runner.layer_windows else 0
    for window in sorted({w for w in runner.layer_windows if w is not None}):
        meta.windowed[window] = (
            meta if max_ctx <= window else dataclasses.replace(meta, groups=groups_for(window), windowed={})
        )
    return ids_t[None], pos_t[None], meta, logits_t


def _lora_step(runner: ModelRunner, seqs: list[ScheduledSeq], order: list[int]) -> LoraStep | None:
    """The step's rows by LoRA adapter (the packed rows are the seqs' tokens in `order`); None
    when the runner has no adapters or no seq uses one."""
    lora = runner.lora
    if lora is None or not any(s.sampling.lora_adapter for s in seqs):
        return None
    row_slots: list[int] = []
    for i in order:
        s = seqs[i]
        row_slots += [lora.slot(s.sampling.lora_adapter)] * len(s.token_ids)
    return lora.step_for(row_slots, runner.device)


def _index_tensors(runner: ModelRunner, parts: Sequence[list[int]]) -> list[torch.Tensor]:
    """The step's index lists as long tensors on the runner's device. On CUDA they are written
    into the runner's pinned staging buffer (pinned.py) and arrive in one non-blocking copy, as
    views of one device tensor; on CPU they are views of one host tensor too (no copy at all),
    each starting 16-byte aligned as on CUDA. The host tensor is built through an int64 array:
    torch.tensor converts a list of Python ints several times slower."""
    if runner.device.type != "cuda":
        packed = array.array("q")
        starts = []
        for p in parts:
            starts.append(len(packed))
            packed.extend(p)
            if len(packed) % 2:
                packed.append(0)
        if not packed:
            packed.append(0)  # frombuffer refuses an empty buffer
        host = torch.frombuffer(packed, dtype=torch.long)  # keeps `packed` alive
        return [host[at : at + len(p)] for p, at in zip(parts, starts, strict=True)]
    return runner.input_staging.pack(parts)


def _seq_attention(
    q_start: int,
    n: int,
    start_pos: int,
    kv_start: int | None,
    blocks: torch.Tensor | None,
    window: int | None,
    dev: torch.device,
) -> attention.SeqAttention:
    """One sequence's PER_SEQ attention for layers with `window` (None: full): query i (position
    start_pos + i) sees keys max(0, start_pos + i - window + 1) .. start_pos + i; keys before
    the first query's first visible one are not read at all (first_key)."""
    ctx = start_pos + n
    fresh = start_pos == 0 and n > 1
    first_key = 0 if window is None else max(0, start_pos - window + 1)
    mask: torch.Tensor | None = None
    if n > 1 and (not fresh or (window is not None and ctx > window)):
        q_pos = torch.arange(start_pos, ctx, device=dev)[:, None]
        k_pos = torch.arange(first_key, ctx, device=dev)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    return attention.SeqAttention(q_start, n, ctx, fresh, kv_start, blocks, mask, first_key)


def _consecutive(blocks: list[int]) -> bool:
    first = blocks[0]
    return all(b == first + i for i, b in enumerate(blocks))
