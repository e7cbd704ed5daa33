"""The lean forward (engine/lean_llama.py) computes exactly what transformers' modules compute:
bit-identical logits and KV pools over fresh prefills, chunked prefills, decode steps on
consecutive and scattered block tables, speculative verify passes and chunk-only steps, on the
oneDNN-packed and the plain-matmul weights and both attention backends; models it does not cover
keep transformers' forward; and it dispatches fewer ops per decode step (the point of it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.step_profile import OpCounter
from services.worker.engine import draws
from services.worker.engine.api import SamplingConfig
from services.worker.engine.attention import AttentionBackend
from services.worker.engine.backend import ModelBackend
from services.worker.engine.lean_llama import LeanLlama
from services.worker.engine.model_loading import kv_layout_of, load_model
from services.worker.engine.model_runner import ModelRunner, ScheduledSeq
from services.worker.engine.options import BackendOptions

GREEDY = SamplingConfig(max_tokens=1, temperature=0.0)
CPU = torch.device("cpu")


def _lean(lean: bool, device: torch.device) -> ModelBackend:
    """The lean forward (or transformers' with False) on `device`, no static steps."""
    return ModelBackend.choose(BackendOptions(lean_forward=lean, cuda_graphs=False), device)


def _steps(bs: int) -> list[list[ScheduledSeq]]:
    """A request life for three sequences: a fresh prefill of two, a first chunk of the third;
    then its last chunk next to two decodes; a verify pass of 4 tokens next to decodes; a step of
    only a non-final chunk (no LM head); plain decodes. Tables: seq 0 consecutive, seqs 1 and 2
    scattered (seq 2 shares no block with the others)."""
    tables = [
        list(range(0, 64 // bs + 2)),
        [90, 71, 80, 60, 99, 61, 62, 63],
        [40, 41, 33, 34, 35, 36, 37, 38],
    ]
    if bs == 1:
        tables[1] = [200 + 3 * i for i in range(60)]
        tables[2] = [500 + 2 * i for i in range(60)]
    p = [[5, 17, 99, 23, 41, 7, 8, 120, 33, 64, 9], [300, 12, 9, 4], list(range(50, 80))]
    return [
        [
            ScheduledSeq(p[0], 0, tables[0], True, GREEDY, None),
            ScheduledSeq(p[1], 0, tables[1], True, GREEDY, None),
            ScheduledSeq(p[2][:20], 0, tables[2], False, GREEDY, None),
        ],
        [
            ScheduledSeq([44], 11, tables[0], True, GREEDY, None),
            ScheduledSeq([45], 4, tables[1], True, GREEDY, None),
            ScheduledSeq(p[2][20:], 20, tables[2], True, GREEDY, None),
        ],
        [
            ScheduledSeq([46, 47, 48, 49], 12, tables[0], True, GREEDY, None, num_logits=4),
            ScheduledSeq([50], 5, tables[1], True, GREEDY, None),
            ScheduledSeq([51], 30, tables[2], True, GREEDY, None),
        ],
        [ScheduledSeq([7, 8, 9], 16, tables[0], False, GREEDY, None)],
        [
            ScheduledSeq([52], 19, tables[0], True, GREEDY, None),
            ScheduledSeq([53], 6, tables[1], True, GREEDY, None),
        ],
        [ScheduledSeq([54], 31, tables[2], True, GREEDY, None)],
    ]


def _run(runner: ModelRunner, steps: list[list[ScheduledSeq]], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Per step: the logits handed to the sampler (None when nothing is sampled), the tokens,
    and finally the KV pool."""
    seen: list[torch.Tensor] = []
    real_sample = draws.sample

    def spy(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(logits.clone())
        return real_sample(logits, *args)

    monkeypatch.setattr(draws, "sample", spy)
    out: list[Any] = []
    for step in steps:
        before = len(seen)
        tokens = runner.execute(step)
        out.append((seen[before] if len(seen) > before else None, tokens))
    out.append(runner.kv_cache.clone())
    return out


def _assert_identical(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for (la, ta), (lb, tb) in zip(a[:-1], b[:-1], strict=True):
        assert ta == tb
        assert (la is None) == (lb is None)
        if la is not None:
            assert torch.equal(la, lb), (la - lb).abs().max()
    assert torch.equal(a[-1], b[-1])  # the same K/V in the same slots


def _both_forwards(
    model: Any,
    block_size: int,
    monkeypatch: pytest.MonkeyPatch,
    backend: AttentionBackend | None = None,
    device: torch.device = CPU,
) -> tuple[list[Any], list[Any]]:
    """`_steps(block_size)` run by a lean runner and by a transformers-forward runner over the same
    model, each with its own pool; asserts each runner took the forward it was asked for."""
    dtype = next(model.parameters()).dtype
    layout = kv_layout_of(model.config, block_size, dtype)
    steps = _steps(block_size)
    blocks = max(b for step in steps for s in step for b in s.block_ids) + 1
    runs = []
    for lean in (True, False):
        runner = ModelRunner(model, layout, blocks, device, dtype, backend, backend=_lean(lean, device))
        assert (runner.lean is not None) is lean
        runs.append(_run(runner, steps, monkeypatch))
    return runs[0], runs[1]


@pytest.mark.parametrize("backend", list(AttentionBackend), ids=lambda b: b.value)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    ("prepack", "row_copy"),
    [(True, False), (True, True), (False, False)],
    ids=["onednn", "rows", "torch-matmul"],
)
def test_lean_forward_is_bit_identical_to_transformers(
    tiny_bpe: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: AttentionBackend,
    block_size: int,
    prepack: bool,
    row_copy: bool,
) -> None:
    """Both forwards, with oneDNN's kernels, with the row copy for steps of 1-2 rows (the steps
    include single-sequence decodes), and with torch's matmul."""
    model = load_model(str(tiny_bpe), CPU, torch.float32, prepack=prepack, row_copy=row_copy)
    assert any(getattr(m, "row_weight", None) is not None for m in model.modules()) is row_copy
    lean, hf = _both_forwards(model, block_size, monkeypatch, backend)
    _assert_identical(lean, hf)
    assert [len(t) for t in lean[2][1]] == [4, 1, 1]  # the verify pass sampled 4 tokens


@pytest.mark.parametrize("backend", list(AttentionBackend), ids=lambda b: b.value)
@pytest.mark.parametrize("block_size", [1, 4])
def test_lean_forward_is_bit_identical_on_a_windowed_mistral(
    tiny_family: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    backend: AttentionBackend,
    block_size: int,
) -> None:
    """Mistral is Llama's decoder with an 8-token window on every layer: the lean loop serves it,
    and its windowed decode steps, verify pass and chunks equal transformers' modules on ours
    (contexts reach 35 tokens)."""
    model = load_model(str(tiny_family("mistral_windowed")), CPU, torch.float32)
    assert LeanLlama.supports(model)
    lean, hf = _both_forwards(model, block_size, monkeypatch, backend)
    _assert_identical(lean, hf)


def test_lean_forward_in_bfloat16_matches_transformers(
    tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 keeps transformers' casts (fp32 RMSNorm statistics); same ops, same numbers."""
    model = load_model(str(tiny_bpe), CPU, torch.bfloat16, prepack=False)
    _assert_identical(*_both_forwards(model, 4, monkeypatch))


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu"),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_lean_forward_matches_transformers_on_each_device(
    tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The same request life on every device the engine runs on: greedy tokens equal, logits and
    KV within fp32 rounding. On CUDA the lean path runs plain F.linear (no oneDNN) and SDPA may
    pick another kernel for its layout than for transformers', so this is a tolerance, not the
    CPU's bit-identity (asserted above)."""
    dev = torch.device(device)
    model = load_model(str(tiny_bpe), dev, torch.float32)
    lean, hf = _both_forwards(model, 4, monkeypatch, device=dev)
    assert len(lean) == len(hf)
    for (la, ta), (lb, tb) in zip(lean[:-1], hf[:-1], strict=True):
        assert ta == tb
        assert (la is None) == (lb is None)
        if la is not None:
            assert la.device.type == device
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lean[-1], hf[-1], rtol=1e-4, atol=1e-4)


def test_models_it_does_not_cover_keep_transformers_forward(tiny_bpe: Path) -> None:
    model = load_model(str(tiny_bpe), CPU, torch.float32)
    layout = kv_layout_of(model.config, 4, torch.float32)
    assert LeanLlama.supports(model)
    model.config.mlp_bias = True  # a variant the flat loop does not implement
    assert not LeanLlama.supports(model)
    assert ModelRunner(model, layout, 8, CPU, torch.float32).lean is None


def test_a_decode_step_dispatches_far_fewer_ops(tiny_bpe: Path) -> None:
    model = load_model(str(tiny_bpe), CPU, torch.float32)
    layout = kv_layout_of(model.config, 4, torch.float32)
    counts = {}
    for lean in (True, False):
        runner = ModelRunner(model, layout, 16, CPU, torch.float32, backend=_lean(lean, CPU))
        runner.execute([ScheduledSeq([5, 6, 7, 8, 9], 0, [0, 1, 2], True, GREEDY, None)])
        counter = OpCounter()
        with counter:
            runner.execute([ScheduledSeq([10], 5, [0, 1, 2], True, GREEDY, None)])
        counts[lean] = sum(counter.counts.values())
    # 2 layers here, so the per-step ops (embedding, RoPE table, sampling) weigh more than in
    # SmolLM2's 30 (where the ratio is 0.49: benchmarks/step_profile.py)
    assert counts[True] < 0.65 * counts[False], counts


@pytest.mark.slow
def test_smollm2_lean_forward_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.model_store import resolve_model

    model = load_model(str(resolve_model("default")), CPU, torch.float32)
    _assert_identical(*_both_forwards(model, 16, monkeypatch))
