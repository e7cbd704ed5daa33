"""Continuous batching: outputs token-identical (greedy, fp32) to transformers generate."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.unit.engine.conftest import (
    EngineFactory,
    drain,
    greedy,
    hf_greedy,
    request,
    tokens_of,
)


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


@pytest.mark.parametrize(
    ("cpu_prepack", "lean_forward"),
    [(True, True), (False, True), (True, False)],
    ids=["onednn-lean", "torch-matmul-lean", "onednn-transformers"],
)
async def test_16_concurrent_requests_match_generate(
    make_engine: EngineFactory, tiny_bpe: Path, cpu_prepack: bool, lean_forward: bool
) -> None:
    from transformers import AutoModelForCausalLM

    # small batch budget so prefill chunks and decodes share steps
    engine = make_engine(max_batch_tokens=128, cpu_prepack=cpu_prepack, lean_forward=lean_forward)
    prompts = _prompts(16, 3, 200, 450)
    max_tokens = [8 + 3 * i for i in range(16)]
    handles = [
        engine.add_request(request(f"r{i}", p, greedy(m, ignore_eos=True)))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    results = await drain(handles)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    for p, m, outs in zip(prompts, max_tokens, results, strict=True):
        assert tokens_of(outs) == hf_greedy(model, p, m)
        last = outs[-1]
        assert last.finished and last.finish_reason is not None
        assert last.finish_reason.value == "length"
        assert last.num_generated_tokens == m
        assert last.num_prompt_tokens == len(p)
        assert all(not o.finished for o in outs[:-1])
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


@pytest.mark.slow
async def test_smollm2_matches_generate(make_engine: EngineFactory) -> None:
    from transformers import AutoModelForCausalLM

    from shared.model_store import resolve_model

    path = resolve_model("default")
    engine = make_engine(model_path=path, kv_cache_tokens=2048, max_batch_tokens=256)
    prompts = _prompts(4, 20, 150, 49000, seed=1)
    handles = [
        engine.add_request(request(f"s{i}", p, greedy(12, ignore_eos=True))) for i, p in enumerate(prompts)
    ]
    results = await drain(handles)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for p, outs in zip(prompts, results, strict=True):
        assert tokens_of(outs) == hf_greedy(model, p, 12)
