"""Static-shape decode and verify steps, replayed as CUDA graphs on a GPU (issue 15, item 3).

Owns `DecodeGraphs`: for a step where every sequence brings one new token (decoding) or, with
speculative decoding, up to k+1 (a verify pass of k proposals, a draft model's catch-up) and
samples its trailing logits, it pads the step to a bucket (B sequences x Q query rows, 1 or k+1,
x NB blocks per sequence), copies
the step's small index tensors into that bucket's static buffers and runs the lean forward on
them; on CUDA the bucket's run is captured once as a CUDA graph and replayed after that.

Why: on a GPU a decode step of a small model is ~1,000 kernel launches issued by one Python
thread. On an H200 (benchmarks/results/engine-cuda.json at commit 0c9a862, 2026-11-26) SmolLM2's
8-sequence step took 15.4 ms, all of it CPU time, against 0.08 ms to read its weights and KV once;
replayed as a graph, 3.5 ms.

Invariants:
- Padding rows (a sequence's rows past its tokens, and whole padding sequences) write their K/V
  to a scratch block past the block manager's blocks (the runner allocates it) and attend to one
  key only, so they never touch a request's KV and never produce a row with every key masked
  (no NaN). Their logits are computed and dropped.
- The attention mask is computed inside the step from each row's context length, so one graph
  serves every step that fits its bucket; nothing in the step reads a tensor's value on the host.
  Layers with a sliding window (`layer_windows`) get their own mask from the same lengths (a row
  at position p sees p - window + 1 .. p), one per distinct window, every step.
- Results equal the BATCHED attention backend's for the same sequences (same kernels, padded
  keys masked with -inf).

With FlexAttention (`flex=True`, CUDA by default, issue 31) a bucket is (B, Q) only: attention
reads each sequence's blocks in place through block tables as wide as the longest sequence
(flex_paged.py), so the context length never changes a shape and no KV is gathered; the graphs
captured at start cover every context. Without it (the torch-only fallback) a bucket also has
NB blocks per sequence, gathered into a padded buffer (attention.py's BATCHED backend).

A bucket's host-filled buffers are views of one tensor, filled from a reused staging buffer
(pinned on CUDA, pinned.py) in one non-blocking copy per step; with async scheduling a decode
step's input ids are then overwritten on the device by the previous step's draws (`run`'s
`input_ids`), so the step needs no token from the host.

On CPU the same static step runs eagerly (`capture=False`): the tests check padding, masking and
the scratch block there, so only capture and replay need a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.engine import attention, attention_batched
from services.worker.engine.flex_paged import FlexPagedStep
from services.worker.engine.lean_llama import LeanLlama
from services.worker.engine.pinned import Staging, to_device

_MIN_BLOCK_BUCKET = 4  # blocks per sequence in the smallest bucket (64 tokens at block size 16)


def _segment(rows: int) -> int:
    """Elements (int64) from one packed buffer's start to the next one's: 16-byte aligned."""
    return -(-rows // 2) * 2


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    size = max(1, minimum)
    while size < n:
        size *= 2
    return size


@dataclass
class _Bucket:
    """Static buffers of one (sequences, query rows, blocks per sequence) bucket, and its graph.
    Row b * Q + i is query token i of sequence b."""

    input_ids: torch.Tensor  # [B * Q] token of each row (padding: 0)
    positions: torch.Tensor  # [B * Q] its position (padding: 0)
    slots: torch.Tensor  # [B * Q] the KV slot it writes (padding: the scratch block's first slot)
    ctx_lens: torch.Tensor  # [B * Q] keys it sees = position + 1 (padding: 1)
    block_table: torch.Tensor  # [B * NB] blocks per sequence (padding: the scratch block)
    key_index: torch.Tensor  # [NB * block_size] 0, 1, ... (constant)
    logits_idx: torch.Tensor  # [B * Q] 0, 1, ... (constant)
    num_blocks: int  # NB (with FlexAttention: the block tables' width, the same for every bucket)
    q: int  # Q
    flex: FlexPagedStep | None = None  # with FlexAttention: block tables and context lengths
    logits: torch.Tensor | None = None  # [B * Q, vocab] the graph's output buffer
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    replays: int = 0  # steps run on this bucket
    packed: torch.Tensor | None = None  # the five host-filled buffers above, as one tensor
    staging: Staging | None = None  # its host side (pinned on CUDA)


@dataclass(frozen=True)
class DecodeSeq:
    """What a static step needs of one sequence."""

    token_ids: Sequence[int]  # its new tokens (1 when decoding, 1 + k when verifying k drafts)
    position: int  # tokens already cached = the first new token's position
    block_ids: Sequence[int]  # covering position + len(token_ids) tokens
    num_logits: int = 1  # trailing tokens whose logits are sampled


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
        spec_tokens: int = 0,  # k of speculative decoding: steps of up to k + 1 rows per sequence
        flex_blocks: int = 0,  # > 0: FlexAttention in place, block tables this wide (blocks)
        layer_windows: Sequence[int | None] = (),  # per layer its attention window (empty: none)
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
        self.layer_windows = tuple(layer_windows)
        # rows per sequence: 1, or k + 1 for every speculative step (verify passes of fewer
        # proposals are padded), so `prepare` can capture every shape serving will meet
        self.q_buckets = (1, spec_tokens + 1) if spec_tokens else (1,)
        self.max_q = self.q_buckets[-1]
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.flex_blocks = flex_blocks

    def _blocks_key(self, need: int) -> int:
        """A bucket's blocks per sequence: one width with FlexAttention, else a power of two."""
        if self.flex_blocks:
            if need > self.flex_blocks:
                raise ValueError(f"a sequence of {need} blocks exceeds the block tables' {self.flex_blocks}")
            return self.flex_blocks
        return bucket(need, _MIN_BLOCK_BUCKET)

    def flex_rows(self, seqs: Sequence[DecodeSeq]) -> FlexPagedStep:
        """With FlexAttention: the FlexPagedStep of the decode bucket for len(seqs) sequences
        (one row each), filled with their block tables and context lengths, for the decode rows
        of an eager mixed step (the bucket's kernel is compiled, its graph captured at start:
        the same shapes, no new compilation)."""
        if not self.flex_blocks:
            raise ValueError("flex_rows needs FlexAttention (flex_blocks > 0)")
        need = max(-(-(s.position + 1) // self.block_size) for s in seqs)
        e = self._bucket(len(seqs), 1, need)
        assert e.flex is not None
        tables = [s.block_ids[: -(-(s.position + 1) // self.block_size)] for s in seqs]
        e.flex.fill(tables, [[s.position + 1] for s in seqs], self.scratch_block)
        return e.flex

    def _bucket(self, num_seqs: int, q: int, need_blocks: int) -> _Bucket:
        """The bucket of num_seqs sequences x q rows whose tables cover need_blocks blocks (made
        on first use)."""
        key = (bucket(num_seqs), q, self._blocks_key(need_blocks))
        return self.buckets.get(key) or self._new_bucket(*key)

    def fits(self, num_tokens: int, num_logits: int) -> bool:
        """Whether a sequence's part of a step can run here."""
        return 1 <= num_logits <= num_tokens <= self.max_q

    def run(self, seqs: Sequence[DecodeSeq], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [sum of num_logits, vocab] (each sequence's trailing rows, in order), K/V of
        the new tokens written. input_ids: decode steps only (one token per sequence), the
        sequences' tokens as a device tensor [len(seqs)] (the previous step's drawn ids, async
        scheduling), copied on the device over the host's placeholders."""
        b = len(seqs)
        bs = self.block_size
        need = max(-(-(s.position + len(s.token_ids)) // bs) for s in seqs)
        q_max = max(len(s.token_ids) for s in seqs)
        q = next(n for n in self.q_buckets if n >= q_max)
        e = self._bucket(b, q, need)
        self._fill(e, seqs)
        if input_ids is not None:
            if q != 1:
                raise ValueError("device-side input ids are for decode steps (one token per sequence)")
            e.input_ids[:b].copy_(input_ids)
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
        if q == 1:
            return e.logits[:b]
        rows = [
            i * q + j
            for i, s in enumerate(seqs)
            for j in range(len(s.token_ids) - s.num_logits, len(s.token_ids))
        ]
        return e.logits.index_select(0, to_device(rows, self.device))

    @torch.inference_mode()
    def prepare(self, max_seqs: int, max_context_tokens: int) -> int:
        """Capture every bucket up to `max_seqs` sequences x `max_context_tokens` tokens each now
        (at start), for decode steps (1 row per sequence) and, with speculation, verify steps
        (k + 1 rows), so serving never stalls on a capture for those shapes; other shapes are
        captured on first use. Largest first: later, smaller graphs reuse the shared pool's
        memory. Returns the number of graphs captured (0 on CPU or with 0 tokens)."""
        if not self.capture or max_context_tokens <= 0:
            return 0
        batch = [1 << i for i in range(bucket(max_seqs).bit_length())]  # 1, 2, 4, ...
        if self.flex_blocks:  # every context in one bucket per batch size
            blocks = [self.flex_blocks]
        else:
            nb_max = bucket(-(-max_context_tokens // self.block_size), _MIN_BLOCK_BUCKET)
            blocks = [_MIN_BLOCK_BUCKET << i for i in range((nb_max // _MIN_BLOCK_BUCKET).bit_length())]
        n = 0
        for b in reversed(batch):
            for q in reversed(self.q_buckets):
                for nb in reversed(blocks):
                    e = self.buckets.get((b, q, nb)) or self._new_bucket(b, q, nb)
                    if e.graph is None:
                        self._capture(e)
                        n += 1
        torch.cuda.synchronize(self.device)
        return n

    # ---- internals -----------------------------------------------------------------------
    def _new_bucket(self, b: int, q: int, nb: int) -> _Bucket:
        dev = self.device
        rows = b * q
        # the host-filled buffers are views of one tensor: a step's values arrive in one copy
        # (from a pinned staging buffer on CUDA, pinned.py). Layout: input_ids, positions, slots,
        # ctx_lens [rows each, every one starting 16-byte aligned: compiled kernels may assume
        # aligned inputs], block_table [b * nb]
        seg = _segment(rows)
        packed = torch.empty(4 * seg + b * nb, dtype=torch.long, device=dev)
        e = _Bucket(
            input_ids=packed[:rows].zero_(),
            positions=packed[seg : seg + rows].zero_(),
            # a new bucket is all padding: its first run (a capture at start) writes only the
            # scratch block
            slots=packed[2 * seg : 2 * seg + rows].fill_(self.scratch_block * self.block_size),
            ctx_lens=packed[3 * seg : 3 * seg + rows].fill_(1),
            block_table=packed[4 * seg :].fill_(self.scratch_block),
            key_index=torch.arange(nb * self.block_size, device=dev),
            logits_idx=torch.arange(rows, device=dev),
            num_blocks=nb,
            q=q,
        )
        e.packed = packed
        # with FlexAttention only input_ids, positions and slots are read (the step's own
        # buffers hold the tables and lengths), so only they are copied
        e.staging = Staging(3 * seg if self.flex_blocks else packed.numel(), torch.long, dev)
        if self.flex_blocks:
            # compiled on CUDA (captured with the step); FlexAttention's reference elsewhere
            e.flex = FlexPagedStep.new(
                b,
                q,
                nb,
                self.block_size,
                self.kv_cache.shape[3] // self.block_size,
                self.scratch_block,
                dev,
                compiled=self.capture,
                windows=tuple(sorted({w for w in self.layer_windows if w is not None})),
            )
        self.buckets[(b, q, nb)] = e
        return e

    def _fill(self, e: _Bucket, seqs: Sequence[DecodeSeq]) -> None:
        """Host-side values of the step into the bucket's buffers: written into a staging
        buffer (pinned on CUDA) through a numpy view, then one copy."""
        bs, nb, q, scratch = self.block_size, e.num_blocks, e.q, self.scratch_block
        b = e.block_table.shape[0] // nb
        rows = b * q
        flex = e.flex is not None
        assert e.staging is not None and e.packed is not None
        seg = _segment(rows)
        numel = 3 * seg if flex else e.packed.numel()
        arr = e.staging.acquire(numel)
        ids, pos, slots = arr[:rows], arr[seg : seg + rows], arr[2 * seg : 2 * seg + rows]
        ids[:] = 0
        pos[:] = 0
        slots[:] = scratch * bs
        ctx: list[list[int]] = []  # per real sequence its Q rows' context lengths (padding: 1)
        tables: list[Sequence[int]] = []  # each sequence's blocks, covering its last row
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            r = i * q
            lens = [1] * q
            for j in range(n):
                p = s.position + j
                ids[r + j] = s.token_ids[j]
                pos[r + j] = p
                slots[r + j] = s.block_ids[p // bs] * bs + p % bs
                lens[j] = p + 1
            ctx.append(lens)
            tables.append(s.block_ids[: -(-(s.position + n) // bs)])
        if e.flex is not None:  # it pads the tables itself (to the width of a whole sequence)
            e.flex.fill(tables, ctx, scratch)
        else:
            ctx_arr, table_arr = arr[3 * seg : 3 * seg + rows], arr[4 * seg :]
            ctx_arr[:] = 1
            table_arr[:] = scratch
            for i, (t, lens) in enumerate(zip(tables, ctx, strict=True)):
                ctx_arr[i * q : (i + 1) * q] = lens
                table_arr[i * nb : i * nb + len(t)] = t
        e.staging.copy_to(e.packed[:numel], numel)

    def _step(self, e: _Bucket) -> torch.Tensor:
        """The lean forward on the bucket's buffers; only device ops (capturable)."""
        meta = attention.PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            block_size=self.block_size,
            slots=e.slots,
            seqs=[],
            decode_idx=None,
            num_decode=0,
            flex=e.flex,
            layer_windows=self.layer_windows,
        )
        if e.flex is None:  # the torch-only path: padded groups over gathered blocks
            self._add_groups(e, meta)
        logits = self.lean.forward(e.input_ids, e.positions, meta, e.logits_idx)
        assert logits is not None
        return logits

    def _add_groups(self, e: _Bucket, meta: attention.PagedAttentionMetadata) -> None:
        """The BATCHED groups of a bucket's step (and one per sliding window), masks computed on
        the device from the bucket's context lengths."""
        nb, q = e.num_blocks, e.q
        b = e.block_table.shape[0] // nb
        keys = nb * self.block_size

        def group(window: int | None) -> attention_batched.BatchedGroup:
            visible = e.key_index[None, :] < e.ctx_lens[:, None]  # [B * Q, keys]
            if window is not None:  # a row at position p = ctx_len - 1 sees p - window + 1 .. p
                visible &= e.key_index[None, :] >= e.ctx_lens[:, None] - window
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~visible, float("-inf"))
            if q == 1:
                mask4 = mask[:, None, None, :]  # [B, 1, 1, keys]: every head row of a sequence
            else:
                # attention.py orders a sequence's rows (query, head of its KV group)
                rep = self.lean.num_heads // self.lean.num_kv_heads
                mask4 = mask.view(b, 1, q, 1, keys).expand(b, 1, q, rep, keys).reshape(b, 1, q * rep, keys)
            return attention_batched.BatchedGroup(
                q_index=None,
                block_table=e.block_table,
                mask=mask4,
                out_rows=None,
                out_positions=None,
                num_seqs=b,
                q_max=q,
                num_blocks_max=nb,
            )

        meta.groups = [group(None)]
        for window in sorted({w for w in self.layer_windows if w is not None}):
            # no host read of the context lengths (capturable): every window gets its mask
            meta.windowed[window] = dataclasses.replace(meta, groups=[group(window)], windowed={})

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
