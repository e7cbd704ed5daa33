"""Static-shape decode steps (engine/decode_graphs.py): padded to buckets, they give the same
logits and greedy tokens as the runner's own path, write K/V only to the requests' slots (padding
goes to the scratch block), and move between buckets as batches and contexts grow. On CPU the
static step runs eagerly; on CUDA it is captured and replayed as a CUDA graph (gpu tests)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine import build as build_module
from services.worker.engine.api import SamplingConfig
from services.worker.engine.attention import AttentionBackend
from services.worker.engine.backend import CudaOptions, ModelBackend
from services.worker.engine.decode_graphs import DecodeSeq, bucket
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.options import BackendOptions
from tests.support.host_reads import host_reads
from tests.support.tiny_models import build_tiny_draft
from tests.unit.engine.conftest import EngineFactory, greedy_tokens

GREEDY = SamplingConfig(max_tokens=1, temperature=0.0)
BLOCK = 4
NUM_BLOCKS = 96


def test_bucket_is_the_next_power_of_two() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert bucket(1, 4) == 4 and bucket(5, 4) == 8


def _backend(device: torch.device, static_steps: bool, fused: bool | None) -> ModelBackend:
    """The lean forward on `device`, with static steps or not; `fused` True: the CUDA layout
    (fused layers, FlexAttention in place), run eagerly on CPU; None: the device's default."""
    base = ModelBackend.choose(BackendOptions(cuda_graphs=False), device)
    kernels = base.cuda.kernels if fused is None else fused
    return replace(base, cuda=CudaOptions(graphs=static_steps, kernels=kernels))


def _runners(
    model_path: Path,
    device: torch.device,
    spec_tokens: int = 0,
    fused: bool | None = False,
    max_model_len: int = 0,
    block: int = BLOCK,
    quantization: str = "",
) -> tuple[ModelRunner, ModelRunner]:
    """The runner's own path (transformers' weights, one model each: fusing rewrites the weights)
    and the static-step path; `fused` True: the CUDA layout (fused layers, FlexAttention in place),
    run eagerly on CPU; None: the device's default."""
    model = load_model(str(model_path), device, torch.float32, quantization=quantization)
    layout = kv_layout_of(model.config, block, torch.float32)
    plain = ModelRunner(
        model, layout, NUM_BLOCKS, device, torch.float32, backend=_backend(device, False, False)
    )
    static_model = (
        load_model(str(model_path), device, torch.float32, prepack=False, quantization=quantization)
        if fused is not False
        else model
    )
    static = ModelRunner(
        static_model,
        layout,
        NUM_BLOCKS,
        device,
        torch.float32,
        backend=_backend(device, True, fused),
        spec_tokens=spec_tokens,
        max_model_len=max_model_len,
    )
    assert static.graphs is not None and plain.graphs is None
    return plain, static


def _decode_together(
    runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]], steps: int
) -> list[list[int]]:
    """Prefill every prompt (one step, the runner's own path), then `steps` decode steps of all
    sequences, the first two sequences finishing early so the batch shrinks across buckets."""
    outs = [
        list(t)
        for t in runner.execute(
            [ScheduledSeq(p, 0, t, True, GREEDY, None) for p, t in zip(prompts, tables, strict=True)]
        )
    ]
    live = list(range(len(prompts)))
    for step in range(steps):
        if step == steps // 2:
            live = live[2:]
        seqs = [
            ScheduledSeq([outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1, tables[i], True, GREEDY, None)
            for i in live
        ]
        for i, new in zip(live, runner.execute(seqs), strict=True):
            outs[i].extend(new)
    return outs


def _check_static_equals_plain(
    model_path: Path,
    device: torch.device,
    fused: bool | None = False,
    tolerance: float = 1e-5,
    block: int = BLOCK,
    quantization: str = "",
) -> None:
    plain, static = _runners(
        model_path, device, fused=fused, max_model_len=64, block=block, quantization=quantization
    )
    # five prompts (bucket 8 of sequences: three padding rows), contexts from 3 to 41 tokens that
    # grow past 16 and 32 (block buckets 4, 8, 16), scattered and consecutive block tables
    prompts = [list(range(7, 7 + n)) for n in (3, 9, 14, 26, 41)]
    tables = [
        [90, 3, 51, 7, 22, 60],
        list(range(10, 16)),
        [1, 88, 40, 41, 2, 70, 71],
        list(range(20, 30)),
        [95, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 61, 62, 63],
    ]
    steps = 12
    want = _decode_together(plain, prompts, tables, steps)
    got = _decode_together(static, prompts, tables, steps)
    assert got == want
    graphs = static.graphs
    assert graphs is not None
    used = {key for key, e in graphs.buckets.items() if e.replays}
    # the batch shrank from 5 to 3 sequences; with FlexAttention every context has one bucket
    # (block tables of max_model_len / block blocks), else contexts grew to as many (53 tokens)
    assert (8, 1, 64 // block) in used and (4, 1, 64 // block) in used
    assert not graphs.flex_blocks or len(used) == 2
    # the same K/V in every request block; only the scratch block (index NUM_BLOCKS) differs
    real = NUM_BLOCKS * block
    torch.testing.assert_close(
        static.kv_cache[:, :, :, :real], plain.kv_cache, rtol=tolerance, atol=tolerance
    )
    assert static.kv_cache[:, :, :, real:].abs().sum() > 0  # padding rows wrote there


@pytest.fixture(params=["llama", "mistral_windowed"])
def decode_model(request: pytest.FixtureRequest, tiny_bpe: Path, tiny_family: Callable[[str], Path]) -> Path:
    """The tiny Llama, and a Mistral with an 8-token window on every layer (the static step's
    mask then hides the keys behind each row's window, contexts reaching 53 tokens)."""
    return tiny_bpe if request.param == "llama" else tiny_family(request.param)


def test_static_decode_steps_equal_the_runner_on_cpu(decode_model: Path) -> None:
    _check_static_equals_plain(decode_model, torch.device("cpu"))


def test_fused_layers_with_attention_in_place_equal_the_runner_on_cpu(decode_model: Path) -> None:
    """The CUDA layout run eagerly on CPU: fused q/k/v and gate/up products, FlexAttention's
    reference over the pool through block tables (no gather; a windowed layer's mask hides the
    keys behind its window), buckets by batch size only. Same greedy tokens, logits within fp32
    rounding, K/V in the requests' blocks as the runner's."""
    _check_static_equals_plain(decode_model, torch.device("cpu"), fused=True)


def test_flex_buckets_ignore_the_context_length(tiny_bpe: Path) -> None:
    """With attention in place, contexts that cross block buckets keep one bucket per batch
    size, and a sequence longer than the block tables is refused, not truncated."""
    plain, static = _runners(tiny_bpe, torch.device("cpu"), fused=True, max_model_len=48)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2]]
    tables = [list(range(30, 37)), [50, 8, 61, 9, 70, 11, 72], [0, 1, 2, 3, 4, 5, 6]]
    want = _decode_together(plain, prompts, tables, 16)
    assert _decode_together(static, prompts, tables, 16) == want
    assert static.graphs is not None and static.graphs.flex_blocks == 12
    assert {key for key, e in static.graphs.buckets.items() if e.replays} == {(4, 1, 12), (1, 1, 12)}
    with pytest.raises(ValueError, match="exceeds the block tables' 12"):
        static.graphs.run([DecodeSeq([5], 48, list(range(13)))])


def test_contexts_grow_into_the_next_block_bucket(tiny_bpe: Path) -> None:
    """Contexts cross 16 tokens (4 blocks of 4) mid-run and two of three sequences finish: the
    steps move through the (sequences, rows, blocks) buckets (4, 1, 4), (4, 1, 8) and (1, 1, 8),
    each with its own buffers, and the tokens stay the runner's."""
    plain, static = _runners(tiny_bpe, torch.device("cpu"))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2]]
    tables = [list(range(30, 37)), [50, 8, 61, 9, 70, 11, 72], [0, 1, 2, 3, 4, 5, 6]]
    want = _decode_together(plain, prompts, tables, 16)
    assert _decode_together(static, prompts, tables, 16) == want
    assert static.graphs is not None
    used = {key for key, e in static.graphs.buckets.items() if e.replays}
    assert used == {(4, 1, 4), (4, 1, 8), (1, 1, 8)}


def test_static_decode_logits_match(tiny_bpe: Path) -> None:
    """Logits, not just argmax: the padded batched step against the per-sequence one."""
    plain, static = _runners(tiny_bpe, torch.device("cpu"))
    tables = [[5, 6, 7], [40, 2, 9]]
    prompts = [[11, 12, 13, 14, 15], [99, 98, 97, 96, 95, 94, 93, 92, 91]]
    for r in (plain, static):
        r.execute([ScheduledSeq(p, 0, t, False, GREEDY, None) for p, t in zip(prompts, tables, strict=True)])
    seqs = [ScheduledSeq([3], len(p), t, True, GREEDY, None) for p, t in zip(prompts, tables, strict=True)]
    assert static.graphs is not None
    with torch.inference_mode():
        input_ids, positions, meta, idx = plain._build_metadata(seqs)
        want = plain._forward(input_ids[0][None], positions, meta, idx)
        got = static.graphs.run([DecodeSeq([3], len(p), t) for p, t in zip(prompts, tables, strict=True)])
    assert want is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_long_or_unsampled_chunks_keep_the_runner_path(tiny_bpe: Path) -> None:
    """A step with a prompt chunk longer than the largest row bucket (8), or a chunk that samples
    nothing, is not a static step: no bucket is used."""
    _, static = _runners(tiny_bpe, torch.device("cpu"))
    static.execute(
        [
            ScheduledSeq(list(range(1, 21)), 0, list(range(5)), True, GREEDY, None),
            ScheduledSeq([4], 3, [6], True, GREEDY, None),
        ]
    )
    static.execute(
        [ScheduledSeq([5, 6], 0, [7], False, GREEDY, None), ScheduledSeq([4], 4, [6, 9], True, GREEDY, None)]
    )
    assert static.graphs is not None and not static.graphs.buckets


@pytest.mark.parametrize("model", ["llama", "mistral_windowed"])
def test_mixed_steps_attend_their_decode_rows_in_place(
    model: str, tiny_bpe: Path, tiny_family: Callable[[str], Path]
) -> None:
    """The BATCHED backend with FlexAttention (the CUDA layout, run eagerly on CPU): a mixed
    step's decode rows attend to the pool in place through a decode bucket's block tables
    (meta.flex_short), its prompt chunks in the groups (a fresh prompt causally over the step's
    own K/V). Same greedy tokens and request K/V as the runner's own path over three mixed steps
    (3 decode rows padded to a bucket of 4; a windowed model's rows honour the window)."""
    _check_mixed_steps(tiny_bpe if model == "llama" else tiny_family(model), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_steps_attend_their_decode_rows_in_place_on_cuda(tiny_bpe: Path) -> None:
    """The same on CUDA: the decode bucket's compiled FlexAttention, called eagerly."""
    _check_mixed_steps(tiny_bpe, torch.device("cuda"), block=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_steps_compile_nothing_after_the_graphs_are_prepared(tiny_bpe: Path) -> None:
    """A mixed step's decode rows run the FlexAttention kernel their decode bucket compiled when
    the graphs were prepared at start: once the eager step's own shapes have run (the first
    mixed step), a mixed step with another bucket of decode rows and another chunk length
    compiles nothing (a compilation while serving stalls the step for seconds)."""
    from torch._dynamo.utils import counters

    _, static = _runners(tiny_bpe, torch.device("cuda"), fused=None, max_model_len=128, block=16)
    graphs = static.graphs
    assert graphs is not None and graphs.flex_blocks and graphs.prepare(8, 128) > 0
    prompts = [list(range(7, 7 + n)) for n in (5, 9, 12, 14, 20)]
    tables = [[i * 8 + j for j in range(8)] for i in range(len(prompts))]
    got = static.execute(
        [ScheduledSeq(p, 0, t, True, GREEDY, None) for p, t in zip(prompts, tables, strict=True)]
    )

    def mixed(rows: int, chunk: int, table0: int) -> None:
        decode = [
            ScheduledSeq([got[i][-1]], len(prompts[i]), tables[i], True, GREEDY, None) for i in range(rows)
        ]
        fresh = ScheduledSeq(
            list(range(100, 100 + chunk)), 0, list(range(table0, table0 + 8)), True, GREEDY, None
        )
        with torch.inference_mode():
            assert static._build_metadata([*decode, fresh])[2].flex_short is not None
        static.execute([*decode, fresh])

    mixed(3, 40, 60)  # bucket 4; compiles the eager step's shapes
    counters.clear()
    mixed(5, 57, 75)  # bucket 8, another chunk length
    assert counters["frames"]["ok"] == 0, dict(counters["frames"])


def _check_mixed_steps(path: Path, device: torch.device, block: int = BLOCK) -> None:
    plain_model = load_model(str(path), device, torch.float32)
    layout = kv_layout_of(plain_model.config, block, torch.float32)
    plain = ModelRunner(
        plain_model, layout, NUM_BLOCKS, device, torch.float32, backend=_backend(device, False, False)
    )
    fused = ModelRunner(
        load_model(str(path), device, torch.float32, prepack=False),
        layout,
        NUM_BLOCKS,
        device,
        torch.float32,
        attention_backend=AttentionBackend.BATCHED,
        backend=_backend(device, True, True),
        max_model_len=128,
    )
    prompts = [list(range(7, 7 + n)) for n in (5, 12, 19)]
    tables = [[90, 3, 51, 7, 22, 60, 61], list(range(10, 17)), [1, 88, 40, 41, 2, 70, 71, 72]]
    long_prompt = list(range(100, 140))  # 40 tokens: the long group, fresh then a later chunk
    long_table = list(range(30, 48))
    outs: dict[str, list[list[int]]] = {}
    for name, runner in (("plain", plain), ("fused", fused)):
        got = runner.execute(
            [ScheduledSeq(p, 0, t, True, GREEDY, None) for p, t in zip(prompts, tables, strict=True)]
        )
        for step in range(3):
            decode = [
                ScheduledSeq([got[i][-1]], len(prompts[i]) + len(got[i]) - 1, tables[i], True, GREEDY, None)
                for i in range(3)
            ]
            chunk = ScheduledSeq(long_prompt[: 36 + step], 0, long_table, True, GREEDY, None)
            if step == 2:  # a later chunk on cached context: the group masks, gathers its blocks
                chunk = ScheduledSeq(long_prompt[36:], 36, long_table, True, GREEDY, None)
            if runner is fused and step == 0:
                with torch.inference_mode():
                    _, _, meta, _ = fused._build_metadata([*decode, chunk])
                assert meta.flex_short is not None and meta.flex_short[1] == 3
                assert meta.groups is not None and [g.fresh for g in meta.groups] == [True]
            new = runner.execute([*decode, chunk])
            for i in range(3):
                got[i].extend(new[i])
            got.append(new[3])
        outs[name] = got
    assert outs["fused"] == outs["plain"]
    graphs = fused.graphs
    assert graphs is not None and (4, 1, 128 // block) in graphs.buckets  # the rows' bucket
    real = NUM_BLOCKS * block
    torch.testing.assert_close(fused.kv_cache[:, :, :, :real], plain.kv_cache, rtol=1e-5, atol=1e-5)


def _verify_step(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """Every sequence's tokens sampled, as speculative decoding's verify pass schedules them."""
    return [
        ScheduledSeq(s.token_ids, s.start_pos, s.block_ids, True, GREEDY, None, len(s.token_ids))
        for s in seqs
    ]


@pytest.mark.parametrize("fused", [False, True])
def test_verify_steps_equal_the_runner(decode_model: Path, fused: bool) -> None:
    """Speculative decoding's verify pass on the static path: sequences with 1, 3 and 6 new
    tokens (0, 2 and 5 drafts) in one step, every row's logits sampled, padded to k + 1 = 6 rows
    per sequence (a step of at most 3 rows too). Tokens, logits and K/V equal the runner's own
    path, also with the CUDA layout (fused layers, FlexAttention in place, its masks per window)."""
    plain, static = _runners(decode_model, torch.device("cpu"), spec_tokens=5, fused=fused, max_model_len=32)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 59)), [2, 7, 1, 8]]
    tables = [list(range(30, 37)), [50, 8, 61, 9, 70, 11, 72], [0, 1, 2, 3, 4, 5, 6]]
    first = [ScheduledSeq(p, 0, t, False, GREEDY, None) for p, t in zip(prompts, tables, strict=True)]
    for r in (plain, static):
        r.execute(first)
    drafts = [[], [17, 18], [9, 9, 9, 9, 9]]
    step = _verify_step(
        [
            ScheduledSeq([5 + i, *d], len(p), t, True, GREEDY, None)
            for i, (p, t, d) in enumerate(zip(prompts, tables, drafts, strict=True))
        ]
    )
    want = plain.execute(step)
    assert static.execute(step) == want
    assert [len(t) for t in want] == [1, 3, 6]
    graphs = static.graphs
    assert graphs is not None and {k for k, e in graphs.buckets.items() if e.replays} == {(4, 6, 8)}
    assert graphs.flex_blocks == (8 if fused else 0)
    real = NUM_BLOCKS * BLOCK
    torch.testing.assert_close(static.kv_cache[:, :, :, :real], plain.kv_cache, rtol=1e-5, atol=1e-5)
    # logits, not just argmax, for a step of at most 3 rows (still the 6-row bucket); nothing is
    # written by the comparison's first pass that the second does not write again identically
    pos = [len(p) + 1 + len(d) for p, d in zip(prompts, drafts, strict=True)]
    nxt = [[7, 8], [3], [1, 2, 3]]
    seqs = _verify_step(
        [ScheduledSeq(n, q, t, True, GREEDY, None) for n, q, t in zip(nxt, pos, tables, strict=True)]
    )
    with torch.inference_mode():
        input_ids, positions, meta, last = plain._build_metadata(seqs)
        # the runner packs single-token sequences first: each sequence's rows end at `last`
        rows = [
            r
            for end, s in zip(last.tolist(), seqs, strict=True)
            for r in range(end - s.num_logits + 1, end + 1)
        ]
        expected = plain._forward(input_ids[0][None], positions, meta, torch.tensor(rows))
        got = graphs.run([DecodeSeq(s.token_ids, s.start_pos, s.block_ids, s.num_logits) for s in seqs])
    assert expected is not None and got.shape == expected.shape == (6, expected.shape[1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert graphs.buckets[(4, 6, 8)].replays == 2


def test_a_few_sampled_tokens_of_a_longer_chunk(tiny_bpe: Path) -> None:
    """A draft model's catch-up step: several tokens (up to k + 1), only the last one's logit
    sampled. Without speculation (k = 0) the same step is not a static one."""
    plain, static = _runners(tiny_bpe, torch.device("cpu"), spec_tokens=5)
    seqs = [
        ScheduledSeq([11, 12, 13, 14, 15], 0, [3, 4], True, GREEDY, None),
        ScheduledSeq([21, 22], 0, [8], True, GREEDY, None),
    ]
    want = plain.execute(seqs)
    assert static.execute(seqs) == want
    assert static.graphs is not None and set(static.graphs.buckets) == {(2, 6, 4)}
    _, no_spec = _runners(tiny_bpe, torch.device("cpu"))
    assert no_spec.execute(seqs) == want
    assert no_spec.graphs is not None and not no_spec.graphs.buckets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_equals_the_runner(tiny_bpe: Path) -> None:
    _check_static_equals_plain(tiny_bpe, torch.device("cuda"))
    _, static = _runners(tiny_bpe, torch.device("cuda"))
    assert static.graphs is not None and static.graphs.capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_with_attention_in_place_equal_the_torch_path(tiny_bpe: Path) -> None:
    """CUDA's default (fused, torch.compile'd layers; FlexAttention over the pool in place; one
    graph per batch size) against the torch-only eager path on the same GPU, fp32: the same
    greedy tokens, K/V within compiled-kernel rounding, and graphs captured at start serve every
    context of a batch size."""
    # blocks of 16 tokens: in place on a GPU needs a multiple of 16 (flex_paged.fits_block_size)
    _check_static_equals_plain(tiny_bpe, torch.device("cuda"), fused=None, tolerance=1e-4, block=16)
    plain, static = _runners(tiny_bpe, torch.device("cuda"), fused=None, max_model_len=64, block=16)
    graphs = static.graphs
    assert graphs is not None and graphs.capture and graphs.flex_blocks == 4
    assert graphs.prepare(8, 64) == 4  # batch buckets 1, 2, 4, 8; contexts need no bucket
    prepared = {key: e.graph for key, e in graphs.buckets.items()}
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2]]
    tables = [list(range(30, 37)), [50, 8, 61, 9, 70, 11, 72], [0, 1, 2, 3, 4, 5, 6]]
    want = _decode_together(plain, prompts, tables, 16)
    assert _decode_together(static, prompts, tables, 16) == want
    assert {key: e.graph for key, e in graphs.buckets.items()} == prepared
    assert {key for key, e in graphs.buckets.items() if e.replays} == {(4, 1, 4), (1, 1, 4)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_in_place_over_32_token_blocks_equal_the_torch_path(tiny_bpe: Path) -> None:
    """`pdserve up --device cuda`'s default block size (32 tokens: FlexAttention's KV tile is
    one block) on the in-place graph path, against the torch-only eager path."""
    _check_static_equals_plain(tiny_bpe, torch.device("cuda"), fused=None, tolerance=1e-4, block=32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_graph_engine_matches_cpu(make_engine: EngineFactory) -> None:
    cpu = make_engine()
    gpu = make_engine(device="cuda", dtype="float32", cuda_graphs=True)
    prompts = [tuple(range(5 + i, 60 + 7 * i)) for i in range(4)]
    assert await greedy_tokens(gpu, prompts, 20) == await greedy_tokens(cpu, prompts, 20)
    assert gpu.num_free_blocks(0) == gpu.num_total_blocks(0)


def test_prepare_captures_nothing_on_cpu(tiny_bpe: Path) -> None:
    _, static = _runners(tiny_bpe, torch.device("cpu"))
    assert static.graphs is not None
    assert static.graphs.prepare(8, 256) == 0 and not static.graphs.buckets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prepared_graphs_serve_without_new_captures(tiny_bpe: Path) -> None:
    """Graphs captured at start (8 sequences x 64 tokens: batch buckets 1-8 x block buckets 4,
    8, 16 of 4-token blocks) write only the scratch block, and the decode steps after them reuse
    them (no capture while serving) with the runner's tokens and K/V."""
    plain, static = _runners(tiny_bpe, torch.device("cuda"))
    assert static.graphs is not None
    before = static.kv_cache[:, :, :, : NUM_BLOCKS * BLOCK].clone()
    assert static.graphs.prepare(8, 0) == 0 and not static.graphs.buckets  # a prefill worker's
    assert static.graphs.prepare(8, 64) == 4 * 3
    assert torch.equal(static.kv_cache[:, :, :, : NUM_BLOCKS * BLOCK], before)
    prepared = {key: e.graph for key, e in static.graphs.buckets.items()}
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3, 5, 6, 2]]
    tables = [list(range(30, 37)), [50, 8, 61, 9, 70, 11, 72], [0, 1, 2, 3, 4, 5, 6]]
    want = _decode_together(plain, prompts, tables, 16)
    assert _decode_together(static, prompts, tables, 16) == want
    assert {key: e.graph for key, e in static.graphs.buckets.items()} == prepared
    assert {key for key, e in static.graphs.buckets.items() if e.replays} == {(4, 1, 4), (4, 1, 8), (1, 1, 8)}


def _spec_prompts() -> list[tuple[int, ...]]:
    """Repeating phrases (the n-gram proposer finds matches) and random tails, mixed lengths."""
    rng = random.Random(5)
    prompts = []
    for i in range(5):
        phrase = tuple(rng.randrange(3, 450) for _ in range(4 + i))
        prompts.append((phrase * 10)[: 18 + 9 * i] + tuple(rng.randrange(3, 450) for _ in range(i)))
    return prompts


@pytest.mark.parametrize("speculative", ["off", "ngram", "draft"])
async def test_engine_on_static_steps_keeps_greedy_identity(
    make_engine: EngineFactory,
    tiny_bpe: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    speculative: str,
) -> None:
    """The whole engine with every runner (the target's and the draft's) on the static-step path
    that CUDA graphs replay, run eagerly on CPU: decode steps, verify steps of k + 1 rows and the
    draft's proposal steps give the same greedy tokens as the engine without it, and every KV
    block comes back."""
    spec: dict[str, Any] = {}
    if speculative == "ngram":
        spec = {
            "speculative": "ngram",
            "num_speculative_tokens": 5,
            "spec_ngram_min": 1,
            "spec_step_cost": False,
        }
    elif speculative == "draft":
        draft = build_tiny_draft(tiny_bpe, tmp_path_factory.mktemp("draft"), num_layers=1)
        spec = {
            "speculative": "draft",
            "draft_model_path": str(draft),
            "num_speculative_tokens": 3,
            "spec_step_cost": False,
        }
    prompts = _spec_prompts()
    want = await greedy_tokens(make_engine(), prompts, 24)
    real = build_module.ModelRunner

    def with_static_steps(*a: Any, **kw: Any) -> ModelRunner:
        backend = kw["backend"]
        return real(*a, **{**kw, "backend": replace(backend, cuda=replace(backend.cuda, graphs=True))})

    monkeypatch.setattr(build_module, "ModelRunner", with_static_steps)
    on = make_engine(**spec)
    assert await greedy_tokens(on, prompts, 24) == want
    assert on.num_free_blocks(0) == on.num_total_blocks(0)
    rank = on._ranks[0]  # type: ignore[attr-defined]
    graphs = rank.runner.graphs
    assert graphs is not None
    used = {key for key, e in graphs.buckets.items() if e.replays}
    assert any(q == 1 for _, q, _ in used)  # plain decode steps
    if speculative != "off":
        k = spec["num_speculative_tokens"]
        assert any(q == k + 1 for _, q, _ in used)  # verify steps of k proposals
    if speculative == "draft":
        proposer = rank.speculation.proposer
        assert proposer.runner.graphs is not None and proposer.runner.graphs.buckets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_graph_verify_steps_match_cpu(make_engine: EngineFactory) -> None:
    """n-gram speculation on CUDA with graphs (the default there): verify steps replayed as
    graphs of k + 1 rows give the CPU engine's greedy tokens."""
    spec = {"speculative": "ngram", "num_speculative_tokens": 5, "spec_ngram_min": 1, "spec_step_cost": False}
    prompts = _spec_prompts()
    want = await greedy_tokens(make_engine(**spec), prompts, 24)
    gpu = make_engine(device="cuda", dtype="float32", **spec)
    assert await greedy_tokens(gpu, prompts, 24) == want
    graphs = gpu._ranks[0].runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.capture
    assert any(q == 6 and e.replays for (_, q, _), e in graphs.buckets.items())
    assert gpu.num_free_blocks(0) == gpu.num_total_blocks(0)


_NO_SYNC_SAMPLING = (
    GREEDY,
    SamplingConfig(max_tokens=1, temperature=0.8, top_p=0.9, seed=7),
    SamplingConfig(max_tokens=1, temperature=1.2, top_k=5, seed=8),
    SamplingConfig(max_tokens=1, temperature=0.9, min_p=0.1, seed=9),
)


def _no_sync_decode_seqs(device: torch.device) -> list[ScheduledSeq]:
    return [
        ScheduledSeq(
            token_ids=[5 + i],
            start_pos=6,
            block_ids=[10 + 2 * i, 11 + 2 * i],
            sample=True,
            sampling=sp,
            generator=torch.Generator(device=device) if sp.seed is not None else None,
            draw_seeds=(sp.seed,) if sp.seed is not None else (),
        )
        for i, sp in enumerate(_NO_SYNC_SAMPLING)
    ]


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "flex"])
def test_a_decode_step_reads_back_only_the_sampled_ids(
    tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """Issue 31 item 4: a static decode step (greedy, seeded temperature / top-p / top-k, no
    logprobs) reads nothing of a tensor on the host but the drawn ids, once, and builds no
    tensor from a host list on the device (on CUDA a pageable copy that waits for the GPU):
    guarded on CPU by failing every such call."""
    _, static = _runners(tiny_bpe, torch.device("cpu"), fused=fused)
    seqs = _no_sync_decode_seqs(torch.device("cpu"))
    want = static.execute(seqs)  # the bucket exists; the guarded step reuses it
    with host_reads(monkeypatch) as reads:
        assert static.execute(seqs) == want  # seeded draws repeat
    assert reads == [len(seqs)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_graph_decode_step_never_synchronizes(tiny_bpe: Path) -> None:
    """The same step as a CUDA graph replay with FlexAttention: filling its inputs, the replay
    and the draw queue no synchronizing call (torch's sync debug mode raises on one); only the
    drawn ids' copy back waits for the GPU."""
    from services.worker.engine.draws import draw

    cuda = torch.device("cuda")
    _, static = _runners(tiny_bpe, cuda, fused=None, block=16)  # in place: blocks of 16
    seqs = _no_sync_decode_seqs(cuda)
    graphs = static.graphs
    assert graphs is not None
    decode = [DecodeSeq(s.token_ids, s.start_pos, s.block_ids) for s in seqs]
    want = static.execute(seqs)  # captures the bucket
    torch.cuda.synchronize()
    # "warn", not "error": every synchronizing call is listed with the Python line that made it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            # as the runner calls it: the buffers filled in place are inference tensors
            with torch.inference_mode():
                drawn = draw(graphs.run(decode), seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert syncs == []
    assert [[int(t)] for t in drawn.tolist()] == want


@pytest.mark.parametrize("path", ["eager", "static", "flex"])
def test_async_decode_steps_take_their_ids_from_the_device(tiny_bpe: Path, path: str) -> None:
    """Async scheduling's runner side (ModelRunner.execute_async): decode steps whose input ids
    are the previous step's draws on the device (the host's token ids are placeholders) give the
    tokens of steps built from the host's ids, on the eager and the static (torch, FlexAttention)
    paths."""
    plain, static = _runners(tiny_bpe, torch.device("cpu"), fused=path == "flex")
    runner = plain if path == "eager" else static
    prompts = [list(range(7, 7 + n)) for n in (3, 9, 14)]
    tables = [[90, 3, 51, 7, 22, 60], list(range(10, 16)), [1, 88, 40, 41, 2, 70, 71]]
    want = _decode_together(plain, prompts, tables, 8)
    first = runner.execute(
        [ScheduledSeq(p, 0, t, True, GREEDY, None) for p, t in zip(prompts, tables, strict=True)]
    )
    pending = None
    got: list[list[int]] = [list(t) for t in first]
    for step in range(8):
        seqs = [
            ScheduledSeq(
                [0 if pending is not None else got[i][-1]],
                len(p) + step,
                t,
                True,
                GREEDY,
                None,
            )
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        pending = runner.execute_async(seqs, None if pending is None else pending.ids)
        for out, new in zip(got, pending.tokens(), strict=True):
            out.extend(new)
    # (the reference run stops the first two sequences halfway)
    assert [g[: len(w)] for w, g in zip(want, got, strict=True)] == want and len(want[2]) == 9
    if path != "eager":
        assert static.graphs is not None and any(e.replays for e in static.graphs.buckets.values())


def test_staging_packs_index_lists_into_one_copy() -> None:
    """pinned.Staging (CUDA's eager step inputs; here on CPU): the lists come back as aligned
    views of one tensor, buffers grow past their size, and a later step's lists (the other
    buffer, then this one again) never change an earlier step's tensors."""
    from services.worker.engine.pinned import Staging

    staging = Staging(4, torch.long, torch.device("cpu"))
    steps = [[[1, 2, 3], [4], [], [5, 6]], [list(range(9)), [7]], [[8, 9], [10, 11, 12]]]
    got = [staging.pack(parts) for parts in steps]
    for parts, tensors in zip(steps, got, strict=True):
        assert [t.tolist() for t in tensors] == parts
        assert all(t.data_ptr() % 16 == 0 for t in tensors if t.numel())
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
