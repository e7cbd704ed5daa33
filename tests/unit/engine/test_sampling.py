"""Sampling: seeded requests are reproducible whatever else is in the batch; top-k 1 / tiny top-p
equal greedy; the batched sampler respects each row's parameters."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.engine.api import SamplingConfig
from services.worker.engine.sampler import sample
from tests.unit.engine.conftest import EngineFactory, drain, greedy, request, tokens_of

PROMPT = tuple(range(10, 40))


def _seeded(seed: int, **kw: Any) -> SamplingConfig:
    return SamplingConfig(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, **kw)


async def test_seeded_sampling_is_reproducible_across_batches(make_engine: EngineFactory) -> None:
    engine = make_engine()
    alone = await drain([engine.add_request(request("a", PROMPT, _seeded(7)))])
    crowd = [engine.add_request(request(f"n{i}", PROMPT[i:], _seeded(100 + i))) for i in range(5)]
    crowd.insert(2, engine.add_request(request("b", PROMPT, _seeded(7))))
    results = await drain(crowd)
    assert tokens_of(results[2]) == tokens_of(alone[0])
    other = await drain([engine.add_request(request("c", PROMPT, _seeded(8)))])
    assert tokens_of(other[0]) != tokens_of(alone[0])


async def test_top_k_1_and_tiny_top_p_are_greedy(make_engine: EngineFactory) -> None:
    engine = make_engine()
    handles = [
        engine.add_request(request("g", PROMPT, greedy(12, ignore_eos=True))),
        engine.add_request(request("k", PROMPT, _seeded(1, top_k=1))),
        engine.add_request(request("p", PROMPT, _seeded(2, top_p=1e-6))),
    ]
    g, k, p = await drain(handles)
    assert tokens_of(k)[:12] == tokens_of(g)
    assert tokens_of(p)[:12] == tokens_of(g)


def test_sampler_rows_follow_their_parameters() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingConfig(max_tokens=1, temperature=0.0),
        SamplingConfig(max_tokens=1, temperature=1.0, top_k=3, seed=1),
        SamplingConfig(max_tokens=1, temperature=1.0, top_p=0.5, seed=2),
        SamplingConfig(max_tokens=1, temperature=0.7),
    ]
    top3 = set(logits[1].topk(3).indices.tolist())
    probs = logits[2].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus: set[int] = set()
    mass = 0.0
    for t in order.tolist():
        nucleus.add(t)
        mass += float(probs[t])
        if mass >= 0.5:
            break
    for trial in range(50):
        gens: list[torch.Generator | None] = [
            None,
            torch.Generator().manual_seed(trial),
            torch.Generator().manual_seed(trial),
            None,
        ]
        out = sample(logits, params, gens).tolist()
        assert out[0] == int(logits[0].argmax())
        assert out[1] in top3
        assert out[2] in nucleus
        assert 0 <= out[3] < 50


def test_seeded_rows_do_not_depend_on_neighbours() -> None:
    logits = torch.randn(3, 30)
    p = SamplingConfig(max_tokens=1, temperature=1.0)
    a = sample(logits[1:2], [p], [torch.Generator().manual_seed(5)])
    b = sample(logits, [p, p, p], [None, torch.Generator().manual_seed(5), None])
    assert int(a[0]) == int(b[1])
