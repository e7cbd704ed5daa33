"""Static-shape decode steps, replayed as CUDA graphs on a GPU (issue 15, item 3).

Owns `DecodeGraphs`: for a decode-only step (every sequence one new token and one sampled
logit) it pads the step to a bucket (B sequences x NB blocks per sequence, both powers of two),
copies the step's small index tensors into that bucket's static buffers and runs the lean forward
on them; on CUDA the bucket's run is captured once as a CUDA graph and replayed after that.

Why: on a GPU a decode step of a small model is ~1,000 kernel launches issued by one Python
thread. On an H200 (engine-cuda.json, 2026-11-26) SmolLM2's 8-sequence step took 15.4 ms, all of
it CPU time, against 0.08 ms to read its weights and KV once. A graph replays the step's kernels
from one launch.

Invariants:
- Padding sequences write their K/V to a scratch block past the block manager's blocks (the
  runner allocates it) and attend to its first slot only, so they never touch a request's KV and
  never produce a row with every key masked (no NaN).
- The attention mask is computed inside the step from the context lengths, so one graph serves
  every step that fits its bucket; nothing in the step reads a tensor's value on the host.
- Results equal the BATCHED attention backend's for the same sequences (same kernels, padded
  keys masked with -inf).

On CPU the same static step runs eagerly (`capture=False`): the tests check padding, masking and
the scratch block there, so only capture and replay need a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.engine import attention
from services.worker.engine.lean_llama import LeanLlama

_MIN_BLOCK_BUCKET = 4  # blocks per sequence in the smallest bucket (64 tokens at block size 16)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    size = max(1, minimum)
    while size < n:
        size *= 2
    return size


@dataclass
class _Bucket:
    """Static buffers of one (sequences, blocks per sequence) bucket, and its graph."""

    input_ids: torch.Tensor  # [B] token of each sequence (padding: 0)
    positions: torch.Tensor  # [B] its position (padding: 0)
    slots: torch.Tensor  # [B] the KV slot it writes (padding: the scratch block's first slot)
    ctx_lens: torch.Tensor  # [B] keys it sees = position + 1 (padding: 1)
    block_table: torch.Tensor  # [B * NB] blocks per sequence (padding: the scratch block)
    key_index: torch.Tensor  # [NB * block_size] 0, 1, ... (constant)
    logits_idx: torch.Tensor  # [B] 0, 1, ... (constant)
    num_blocks: int  # NB
    logits: torch.Tensor | None = None  # [B, vocab] the graph's output buffer
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    replays: int = 0  # steps run on this bucket


@dataclass(frozen=True)
class DecodeSeq:
    """What a decode step needs of one sequence."""

    token_id: int
    position: int  # tokens already cached = the new token's position
    block_ids: Sequence[int]  # covering position + 1 tokens


class DecodeGraphs:
    def __init__(
        self,
        lean: LeanLlama,
        kv_cache: torch.Tensor,  # the rank's pool, attention.py's layout
        block_size: int,
        scratch_block: int,  # a block no request is ever given
        dtype: torch.dtype,
        device: torch.device,
        capture: bool,  # CUDA graphs (CUDA only); False = run the static step eagerly
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.lean = lean
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.dtype = dtype
        self.device = device
        self.capture = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None

    def run(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step, K/V of the new tokens written."""
        b = len(seqs)
        bs = self.block_size
        need = max(-(-(s.position + 1) // bs) for s in seqs)
        key = (bucket(b), bucket(need, _MIN_BLOCK_BUCKET))
        e = self.buckets.get(key) or self._new_bucket(*key)
        self._fill(e, seqs)
        if not self.capture:
            e.logits = self._step(e)
        elif e.graph is None:
            self._capture(e)
            assert e.graph is not None
            e.graph.replay()
        else:
            e.graph.replay()
        e.replays += 1
        assert e.logits is not None
        return e.logits[:b]

    def prepare(self, max_seqs: int, max_context_tokens: int) -> int:
        """Capture every bucket up to `max_seqs` sequences x `max_context_tokens` tokens each now
        (at start), so serving never stalls on a capture for those shapes; larger steps are
        captured on first use. Largest first: later, smaller graphs reuse the shared pool's
        memory. Returns the number of graphs captured (0 on CPU)."""
        if not self.capture:
            return 0
        nb_max = bucket(-(-max_context_tokens // self.block_size), _MIN_BLOCK_BUCKET)
        batch = [bucket(1) << i for i in range(bucket(max_seqs).bit_length())]
        blocks = [_MIN_BLOCK_BUCKET << i for i in range((nb_max // _MIN_BLOCK_BUCKET).bit_length())]
        n = 0
        for b in reversed(batch):
            for nb in reversed(blocks):
                e = self.buckets.get((b, nb)) or self._new_bucket(b, nb)
                if e.graph is None:
                    self._capture(e)
                    n += 1
        torch.cuda.synchronize(self.device)
        return n

    # ---- internals -----------------------------------------------------------------------
    def _new_bucket(self, b: int, nb: int) -> _Bucket:
        dev = self.device
        e = _Bucket(
            input_ids=torch.zeros(b, dtype=torch.long, device=dev),
            positions=torch.zeros(b, dtype=torch.long, device=dev),
            # a new bucket is all padding: its first run (a capture at start) writes only the
            # scratch block
            slots=torch.full((b,), self.scratch_block * self.block_size, dtype=torch.long, device=dev),
            ctx_lens=torch.ones(b, dtype=torch.long, device=dev),
            block_table=torch.full((b * nb,), self.scratch_block, dtype=torch.long, device=dev),
            key_index=torch.arange(nb * self.block_size, device=dev),
            logits_idx=torch.arange(b, device=dev),
            num_blocks=nb,
        )
        self.buckets[(b, nb)] = e
        return e

    def _fill(self, e: _Bucket, seqs: Sequence[DecodeSeq]) -> None:
        """Host-side values of the step into the bucket's buffers (one copy each)."""
        bs, nb, scratch = self.block_size, e.num_blocks, self.scratch_block
        b = e.input_ids.shape[0]
        pad = b - len(seqs)
        ids = [s.token_id for s in seqs] + [0] * pad
        pos = [s.position for s in seqs] + [0] * pad
        slots = [s.block_ids[s.position // bs] * bs + s.position % bs for s in seqs]
        slots += [scratch * bs] * pad
        ctx = [s.position + 1 for s in seqs] + [1] * pad
        table: list[int] = []
        for s in seqs:
            used = list(s.block_ids[: -(-(s.position + 1) // bs)])
            table.extend(used + [scratch] * (nb - len(used)))
        table.extend([scratch] * (nb * pad))
        for buf, values in (
            (e.input_ids, ids),
            (e.positions, pos),
            (e.slots, slots),
            (e.ctx_lens, ctx),
            (e.block_table, table),
        ):
            buf.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

    def _step(self, e: _Bucket) -> torch.Tensor:
        """The lean forward on the bucket's buffers; only device ops (capturable)."""
        b, nb = e.input_ids.shape[0], e.num_blocks
        visible = e.key_index[None, :] < e.ctx_lens[:, None]  # [B, NB * block_size]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, float("-inf"))
        group = attention.BatchedGroup(
            q_index=None,
            block_table=e.block_table,
            mask=mask[:, None, None, :],  # [B, 1, 1, keys]: every query row of a sequence
            out_rows=None,
            out_positions=None,
            num_seqs=b,
            q_max=1,
            num_blocks_max=nb,
        )
        meta = attention.PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            block_size=self.block_size,
            slots=e.slots,
            seqs=[],
            decode_idx=None,
            num_decode=0,
            groups=[group],
        )
        logits = self.lean.forward(e.input_ids, e.positions, meta, e.logits_idx)
        assert logits is not None
        return logits

    def _capture(self, e: _Bucket) -> None:
        # torch's recipe: warm up on a side stream (lazy library and workspace set-up must not
        # happen during capture), then capture into the graphs' shared memory pool. The warm-up
        # steps rewrite the same K/V into the same slots, so running them is harmless.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(e)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the worker (KV transfer) may use the GPU meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            e.logits = self._step(e)
        e.graph = graph
