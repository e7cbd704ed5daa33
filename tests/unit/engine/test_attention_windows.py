"""Per-layer attention windows and soft-capping in the paged attention (engine/attention.py): on
every path (BATCHED, PER_SEQ with the CPU decode kernel and with SDPA per sequence) a windowed
layer's output equals dense attention with transformers' window mask (a query at position p sees
keys p - W + 1 .. p), and a full layer's equals dense causal attention, for decodes, verify
passes, later prefill chunks, fresh prefills longer than the window and contexts shorter than
it, over scattered block tables of several block sizes."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine import cpu_kernels
from services.worker.engine.api import KvLayout, SamplingConfig
from services.worker.engine.attention import AttentionBackend, paged_attention_forward
from services.worker.engine.backend import ModelBackend
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.options import BackendOptions

GREEDY = SamplingConfig(max_tokens=1, temperature=0.0)
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
CPU = torch.device("cpu")
SCALE = HEAD_DIM**-0.5

# (start_pos, new tokens) per sequence of one step: decodes past and within the window, a verify
# pass of 5 tokens, a later prefill chunk, a fresh prefill, a one-token prompt
STEP = [(37, 1), (2, 1), (20, 5), (16, 12), (0, 30), (0, 1), (9, 1)]

PATHS = {
    "batched": (AttentionBackend.BATCHED, False),
    "per_seq_kernel": (AttentionBackend.PER_SEQ, True),
    "per_seq_sdpa": (AttentionBackend.PER_SEQ, False),
}


def _model(window: int, softcap: float | None = None) -> Any:
    """A stand-in with only the config the runner reads: layer 0 windowed, layer 1 full."""
    config = SimpleNamespace(
        num_attention_heads=HEADS,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
        attn_logit_softcapping=softcap,
    )
    return SimpleNamespace(config=config)


def _step(bs: int) -> list[ScheduledSeq]:
    rng = random.Random(bs)
    free = list(range(4096 // bs))
    rng.shuffle(free)
    seqs = []
    for i, (start, n) in enumerate(STEP):
        blocks = [free.pop() for _ in range(-(-(start + n) // bs))]
        seqs.append(ScheduledSeq(list(range(10 + i, 10 + i + n)), start, blocks, True, GREEDY, None))
    return seqs


def _reference(
    q: torch.Tensor,  # [1, heads, n, D]
    k: torch.Tensor,  # [1, kv_heads, ctx, D]
    v: torch.Tensor,
    start: int,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Dense attention of queries at positions start.. over keys 0..ctx-1 -> [n, heads, D]."""
    n, ctx = q.shape[2], k.shape[2]
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-2, -1)) * SCALE
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, -1) @ v)[0].transpose(0, 1)


def _check(path: str, bs: int, window: int, softcap: float | None = None) -> None:
    backend, kernel = PATHS[path]
    if kernel and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    seqs = _step(bs)
    num_blocks = 4096 // bs
    layout = KvLayout(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=bs, dtype="float32")
    runner = ModelRunner(
        _model(window, softcap),
        layout,
        num_blocks,
        CPU,
        torch.float32,
        backend,
        backend=ModelBackend.choose(BackendOptions(cpu_attention_kernel=kernel), CPU),
    )
    gen = torch.Generator().manual_seed(bs + window)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen))
    _, _, meta, _ = runner._build_metadata(seqs)
    assert meta.layer_windows == (window, None)
    if path == "per_seq_kernel" and softcap is None:  # the kernel serves the decodes...
        assert meta.decode_spans is not None
        starts = meta.for_layer(0).decode_starts  # ...from each one's first key in the window
        assert starts is not None and starts.tolist() == [max(0, s + 1 - window) for s in (37, 2, 0, 9)]
    tokens = meta.slots.shape[0]
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    packed_of_slot = {int(s): i for i, s in enumerate(meta.slots.tolist())}
    for layer, layer_window in ((0, window), (1, None)):
        module: Any = SimpleNamespace(layer_idx=layer)
        out, _ = paged_attention_forward(
            module, q, k, v, None, scaling=SCALE, paged_meta=meta, softcap=softcap
        )
        pool = runner.kv_cache[layer]
        for s in seqs:
            ctx = s.start_pos + len(s.token_ids)
            slots = [s.block_ids[p // bs] * bs + p % bs for p in range(ctx)]
            rows = torch.tensor([packed_of_slot[slot] for slot in slots[s.start_pos :]])
            keys = pool[0][:, slots][None]
            values = pool[1][:, slots][None]
            want = _reference(q[:, :, rows], keys, values, s.start_pos, layer_window, softcap)
            torch.testing.assert_close(out[0, rows], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_windowed_layers_equal_dense_window_attention(path: str, bs: int, window: int) -> None:
    _check(path, bs, window)


@pytest.mark.parametrize("path", list(PATHS))
def test_soft_capped_attention_equals_transformers_formula(path: str) -> None:
    """cap * tanh(scores / cap) before the mask, windowed and full layers (the CPU kernel does
    not soft-cap: the runner keeps SDPA-free eager math for such models on every path)."""
    _check(path, 4, 5, softcap=2.0)


def test_soft_capped_models_never_use_the_decode_kernel() -> None:
    layout = KvLayout(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=4, dtype="float32")
    runner = ModelRunner(_model(5, 30.0), layout, 64, CPU, torch.float32, AttentionBackend.PER_SEQ)
    assert not runner.cpu_attention_kernel
    _, _, meta, _ = runner._build_metadata(_step(4))
    assert meta.decode_spans is None


def test_models_without_windows_build_no_variants() -> None:
    """Outputs of full-attention models are untouched: no per-layer windows, no variants."""
    layout = KvLayout(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=4, dtype="float32")
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=HEADS, num_hidden_layers=2))
    runner = ModelRunner(model, layout, 1024, CPU, torch.float32, AttentionBackend.PER_SEQ)
    _, _, meta, _ = runner._build_metadata(_step(4))
    assert meta.layer_windows == () and meta.windowed == {}
    assert meta.for_layer(0) is meta and meta.for_layer(1) is meta


def test_a_window_no_sequence_reaches_reuses_the_step_metadata() -> None:
    layout = KvLayout(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=4, dtype="float32")
    runner = ModelRunner(_model(64), layout, 1024, CPU, torch.float32, AttentionBackend.PER_SEQ)
    _, _, meta, _ = runner._build_metadata(_step(4))  # contexts of at most 38 tokens
    assert meta.for_layer(0) is meta


def test_sdpa_reference_agrees_with_the_formula() -> None:
    """The dense reference above is SDPA with the window mask (guards the reference itself)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, 4, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, 9, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, 9, HEAD_DIM, generator=gen)
    q_pos = torch.arange(5, 9)[:, None]
    k_pos = torch.arange(9)[None, :]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - 3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(_reference(q, k, v, 5, 3, None), want[0].transpose(0, 1))
