"""Sampling: seeded requests are reproducible whatever else is in the batch; top-k 1 / tiny top-p
/ min-p 1 equal greedy; the batched sampler respects each row's parameters; min-p keeps vLLM's
tokens, in vLLM's order (after temperature, before top-k / top-p)."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.engine.api import SamplingConfig
from services.worker.engine.sampler import sample, scaled_logits
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
        engine.add_request(request("m", PROMPT, _seeded(3, min_p=1.0))),
    ]
    g, k, p, m = await drain(handles)
    assert tokens_of(k)[:12] == tokens_of(g)
    assert tokens_of(p)[:12] == tokens_of(g)
    assert tokens_of(m)[:12] == tokens_of(g)  # min_p 1 keeps only the most likely token


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


def _min_p_reference(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor written out: probabilities after temperature, tokens below
    min_p x the largest at -inf."""
    scaled = logits / temperature
    probs = scaled.softmax(-1)
    return scaled.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def test_min_p_keeps_the_tokens_vllm_keeps_after_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 200)
    params = [
        SamplingConfig(max_tokens=1, temperature=0.7, min_p=0.05),
        SamplingConfig(max_tokens=1, temperature=1.5, min_p=0.3),
        SamplingConfig(max_tokens=1, temperature=1.0),  # min_p off
        SamplingConfig(max_tokens=1, temperature=0.0, min_p=0.9),  # greedy: ignored
        SamplingConfig(max_tokens=1, temperature=1.0, min_p=1.0),
    ]
    got = scaled_logits(logits, params)
    for row, t in ((0, 0.7), (1, 1.5), (4, 1.0)):
        want = _min_p_reference(logits[row], t, params[row].min_p)
        assert torch.equal(got[row].isinf(), want.isinf()), row
        assert torch.allclose(got[row][~want.isinf()], want[~want.isinf()])
    assert 1 < int(got[0].isfinite().sum()) < 200  # the threshold does cut, and keeps several
    assert torch.equal(got[2], logits[2]) and torch.equal(got[3], logits[3])
    assert got[4].isfinite().nonzero().flatten().tolist() == [int(logits[4].argmax())]


def test_min_p_comes_before_top_k_and_top_p() -> None:
    """top-k and top-p cut the distribution min-p left (renormalised), as vLLM applies them."""
    torch.manual_seed(1)
    logits = torch.randn(1, 100) * 2
    after_min_p = _min_p_reference(logits[0], 1.0, 0.1)
    kept = int(after_min_p.isfinite().sum())
    assert kept > 4
    top_k = scaled_logits(logits, [SamplingConfig(max_tokens=1, temperature=1.0, min_p=0.1, top_k=kept + 10)])
    assert int(top_k.isfinite().sum()) == kept  # k beyond what min-p kept changes nothing
    # the nucleus of the renormalised min-p distribution, which holds more tokens than the same
    # top_p over the whole one would
    probs = after_min_p.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, 0
    for t in order:
        nucleus += 1
        mass += float(probs[t])
        if mass >= 0.6:
            break
    top_p = scaled_logits(logits, [SamplingConfig(max_tokens=1, temperature=1.0, min_p=0.1, top_p=0.6)])
    assert int(top_p.isfinite().sum()) == nucleus


def test_min_p_draws_stay_in_the_kept_set() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 60)
    params = [SamplingConfig(max_tokens=1, temperature=1.3, min_p=0.2, seed=1)] * 2
    kept = set(_min_p_reference(logits[0], 1.3, 0.2).isfinite().nonzero().flatten().tolist())
    seen = set()
    for trial in range(200):
        out = sample(logits, params, [torch.Generator().manual_seed(trial), None]).tolist()
        assert out[0] in kept
        seen.add(out[0])
    assert len(seen) > 1  # it samples, not argmax
