"""Batched paged attention (one call per layer for a group of sequences) equals the per-sequence
path: mixed context lengths, block sizes, scattered and consecutive block tables, shared prefix
blocks, query lengths > 1 on cached context (speculative verify, later prefill chunks) and fresh
prefills; and a runner on the batched path generates transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.worker.engine.api import KvLayout, SamplingConfig
from services.worker.engine.attention import AttentionBackend, paged_attention_forward
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from tests.support.host_reads import host_reads
from tests.unit.engine.conftest import hf_greedy

GREEDY = SamplingConfig(max_tokens=1, temperature=0.0)
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 6, 2, 8, 2
CPU = torch.device("cpu")


def _runner(
    backend: AttentionBackend,
    block_size: int,
    num_blocks: int,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> ModelRunner:
    layout = KvLayout(
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
    )
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=HEADS))
    return ModelRunner(model, layout, num_blocks, device, dtype, backend)


def _seq(start: int, n: int, blocks: list[int]) -> ScheduledSeq:
    return ScheduledSeq(list(range(100, 100 + n)), start, blocks, True, GREEDY, None)


def _scenarios(bs: int) -> dict[str, list[ScheduledSeq]]:
    import random

    rng = random.Random(bs)
    free = list(range(1000))
    rng.shuffle(free)
    next_run = [2000]

    def scattered(tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-tokens // bs))]

    def consecutive(tokens: int) -> list[int]:
        first = next_run[0]
        next_run[0] += -(-tokens // bs) + 1
        return list(range(first, next_run[0] - 1))

    shared = scattered(2 * bs)  # two full blocks of a common prefix (a prefix-cache hit)
    return {
        "decode_mixed_lengths": [
            _seq(37, 1, scattered(38)),
            _seq(5, 1, consecutive(6)),
            _seq(0, 1, scattered(1)),
            _seq(2 * bs + 3, 1, shared + scattered(4)),
            _seq(2 * bs, 1, shared + consecutive(1)),
        ],
        "verify_and_chunks": [
            _seq(20, 1, consecutive(21)),
            _seq(2 * bs + 1, 5, shared + scattered(6)),  # verify k+1 = 5 past a shared prefix
            _seq(16, 40, scattered(56)),  # a later prefill chunk (the long group)
            _seq(0, 9, scattered(9)),  # a fresh prefill
            _seq(3, 2, consecutive(5)),
        ],
        "short_only": [
            _seq(11, 3, scattered(14)),
            _seq(bs, 1, consecutive(bs + 1)),
        ],
        "long_only": [
            _seq(0, 33, consecutive(33)),
            _seq(7, 35, scattered(42)),
        ],
        # one request's first chunk: BATCHED attends to the step's own K/V (causal, no gather)
        "fresh_prompt": [_seq(0, 37, scattered(37))],
        # a mixed step: decode rows and one request's first chunk, which attends to the step's
        # own K/V as above (its rows a span of the packed step)
        "decode_and_fresh_prompt": [
            _seq(9, 1, scattered(10)),
            _seq(0, 35, scattered(35)),
            _seq(2 * bs, 1, shared + consecutive(1)),
        ],
    }


ALL_SCENARIOS = [
    "decode_mixed_lengths",
    "verify_and_chunks",
    "short_only",
    "long_only",
    "fresh_prompt",
    "decode_and_fresh_prompt",
]
# which groups of a scenario attend causally over the step's own K/V (none elsewhere)
FRESH = {"fresh_prompt": [True], "decode_and_fresh_prompt": [False, True]}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
def test_batched_equals_per_sequence(block_size: int, scenario: str) -> None:
    _compare_backends(block_size, scenario, torch.device("cpu"), torch.float32, 1e-5)


@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
def test_batched_equals_per_sequence_in_bfloat16(scenario: str) -> None:
    _compare_backends(4, scenario, torch.device("cpu"), torch.bfloat16, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
def test_batched_equals_per_sequence_on_cuda(scenario: str) -> None:
    _compare_backends(16, scenario, torch.device("cuda"), torch.float32, 1e-4)


def _compare_backends(
    block_size: int, scenario: str, device: torch.device, dtype: torch.dtype, tol: float
) -> None:
    seqs = _scenarios(block_size)[scenario]
    num_blocks = max(max(s.block_ids) for s in seqs) + 1
    gen = torch.Generator().manual_seed(block_size)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    pool = rand(LAYERS, 2, KV_HEADS, num_blocks * block_size, HEAD_DIM)
    tokens = sum(len(s.token_ids) for s in seqs)
    q = rand(1, HEADS, tokens, HEAD_DIM)
    k = rand(1, KV_HEADS, tokens, HEAD_DIM)
    v = rand(1, KV_HEADS, tokens, HEAD_DIM)
    results = {}
    for backend in AttentionBackend:
        runner = _runner(backend, block_size, num_blocks, device, dtype)
        runner.kv_cache.copy_(pool)
        _, positions, meta, _ = runner._build_metadata(seqs)
        if backend is AttentionBackend.BATCHED:
            assert meta.groups is not None
            fresh = [g.fresh for g in meta.groups]
            assert fresh == FRESH.get(scenario, [False] * len(fresh))
        # both backends pack the sequences in their own order: feed each the same per-token
        # q/k/v by position of the token in the caller's sequence list
        order = torch.tensor(_packed_order(seqs, positions[0].tolist()), device=device)
        layer: Any = SimpleNamespace(layer_idx=1)  # only its layer index is read
        out, _ = paged_attention_forward(
            layer,
            q[:, :, order],
            k[:, :, order],
            v[:, :, order],
            None,
            scaling=HEAD_DIM**-0.5,
            paged_meta=meta,
        )
        unpacked = torch.empty_like(out)
        unpacked[:, order] = out
        results[backend] = (unpacked, runner.kv_cache.clone())
    batched, per_seq = results[AttentionBackend.BATCHED], results[AttentionBackend.PER_SEQ]
    torch.testing.assert_close(batched[0], per_seq[0], rtol=tol, atol=tol)
    assert torch.equal(batched[1], per_seq[1])  # the same K/V written to the same slots


def _packed_order(seqs: list[ScheduledSeq], packed_positions: list[int]) -> list[int]:
    """Index into the caller-order token list of each packed token (tokens are identified by
    (position, sequence), and positions are unique within one sequence)."""
    caller: list[tuple[int, int]] = []
    for i, s in enumerate(seqs):
        caller.extend((i, s.start_pos + j) for j in range(len(s.token_ids)))
    # packed order groups tokens by sequence; recover the sequence of each run of positions
    remaining = {key: idx for idx, key in enumerate(caller)}
    order: list[int] = []
    j = 0
    while j < len(packed_positions):
        start = packed_positions[j]
        seq = next(i for i, s in enumerate(seqs) if s.start_pos == start and (i, start) in remaining)
        for t in range(len(seqs[seq].token_ids)):
            order.append(remaining.pop((seq, start + t)))
        j += len(seqs[seq].token_ids)
    return order


def test_batched_runner_matches_transformers_greedy(tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts decoded together on the batched path, the first prefilled in two chunks
    (the second attends to the first through the pool), scattered block tables. The mixed step
    (a chunk and two decodes) reads back only the drawn ids and copies no host list to the
    device outside the step's one packed copy (issue 31 item 4: on CUDA, the path of every
    prefill and mixed step)."""
    model = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32)
    layout = kv_layout_of(model.config, 4, torch.float32)
    runner = ModelRunner(model, layout, 64, torch.device("cpu"), torch.float32, AttentionBackend.BATCHED)
    prompts = [[5, 17, 99, 23, 41, 7, 8, 120, 33, 64], [300, 12, 9], [44] * 6 + [45, 46]]
    tables = [[3, 1, 8, 20, 21, 22], [40, 10, 11, 12, 13], [30, 31, 32, 2, 5, 6]]
    steps = 10
    outs: list[list[int]] = [[] for _ in prompts]
    first = runner.execute(
        [
            ScheduledSeq(prompts[0][:6], 0, tables[0], False, GREEDY, None),
            ScheduledSeq(prompts[1], 0, tables[1], True, GREEDY, None),
            ScheduledSeq(prompts[2], 0, tables[2], True, GREEDY, None),
        ]
    )
    outs[1].extend(first[0])
    outs[2].extend(first[1])
    with host_reads(monkeypatch) as reads:
        mixed = runner.execute(
            [
                ScheduledSeq(prompts[0][6:], 6, tables[0], True, GREEDY, None),
                ScheduledSeq([outs[1][-1]], len(prompts[1]), tables[1], True, GREEDY, None),
                ScheduledSeq([outs[2][-1]], len(prompts[2]), tables[2], True, GREEDY, None),
            ]
        )
    assert reads == [3]
    for i, t in enumerate(mixed):
        outs[i].extend(t)
    while min(len(o) for o in outs) < steps:
        live = [i for i in range(3) if len(outs[i]) < steps]
        got = runner.execute(
            [
                ScheduledSeq([outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1, tables[i], True, GREEDY, None)
                for i in live
            ]
        )
        for i, t in zip(live, got, strict=True):
            outs[i].extend(t)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(reference, prompt, steps)


def test_verify_pass_samples_the_same_tokens_on_both_paths(tiny_bpe: Path) -> None:
    """A speculative verify step (k+1 tokens per sequence on cached context, logits at all of
    them) next to a plain decode: both backends sample the same tokens."""
    model = load_model(str(tiny_bpe), torch.device("cpu"), torch.float32)
    layout = kv_layout_of(model.config, 4, torch.float32)
    got = {}
    for backend in AttentionBackend:
        runner = ModelRunner(model, layout, 32, torch.device("cpu"), torch.float32, backend)
        runner.execute(
            [
                ScheduledSeq([5, 17, 99, 23, 41, 7, 8], 0, [9, 2, 4, 11], False, GREEDY, None),
                ScheduledSeq([300, 12, 9, 40, 41], 0, [20, 21, 22], False, GREEDY, None),
            ]
        )
        got[backend] = runner.execute(
            [
                ScheduledSeq([120, 33, 64, 7], 7, [9, 2, 4, 11], True, GREEDY, None, num_logits=4),
                ScheduledSeq([42], 5, [20, 21, 22], True, GREEDY, None),
            ]
        )
    assert [len(t) for t in got[AttentionBackend.BATCHED]] == [4, 1]
    assert got[AttentionBackend.BATCHED] == got[AttentionBackend.PER_SEQ]
