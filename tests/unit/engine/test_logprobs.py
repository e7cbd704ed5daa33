"""Logprobs: those of the distribution the sampler drew from (after penalties, bias, temperature,
top-k / top-p), one entry per generated token, identical unified, disaggregated (the first
token's from the prefill engine), after a migration and with speculation on."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch

from services.worker.engine.api import FinishReason, RequestKind, RequestOutput, SamplingConfig, TokenLogprobs
from services.worker.engine.sampler import (
    TokenHistory,
    prompt_logprobs,
    sample,
    sample_with_logprobs,
    token_ranks,
)
from shared.errors import InvalidArgument
from tests.unit.engine.conftest import EngineFactory, collect, greedy, handoff_run, request, tokens_of


def test_logprobs_are_those_of_the_processed_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 2
    hist = TokenHistory(list(range(10)), 4)
    params = [
        SamplingConfig(max_tokens=1, temperature=0.0, logprobs=3, presence_penalty=1.0),
        SamplingConfig(max_tokens=1, temperature=0.5, top_k=5, logprobs=0, seed=1),
        SamplingConfig(max_tokens=1, temperature=1.0),  # no logprobs asked
        SamplingConfig(max_tokens=1, temperature=2.0, logprobs=20, logit_bias=((4, 3.0),), seed=2),
    ]
    gens = [None, torch.Generator(), None, torch.Generator()]
    seeds = [None, 11, None, 12]
    hists = [hist, None, None, None]
    tokens, lps = sample_with_logprobs(logits, params, gens, seeds, hists)
    again = sample(logits, params, [None, torch.Generator(), None, torch.Generator()], seeds, hists)
    assert tokens[[0, 1, 3]].tolist() == again[[0, 1, 3]].tolist()  # logprobs never change the draw
    greedy, topk, none, hot = lps
    assert none is None and greedy is not None and topk is not None and hot is not None
    # greedy: penalized logits, no temperature; the chosen token is the most likely one
    penalized = logits[0].clone()
    penalized[6:10] -= 1.0
    want = penalized.log_softmax(-1)
    assert greedy.token_id == int(want.argmax()) and greedy.top[0] == (greedy.token_id, greedy.logprob)
    assert [t for t, _ in greedy.top] == want.topk(3).indices.tolist()
    assert math.isclose(greedy.logprob, float(want.max()), rel_tol=1e-6)
    assert greedy.rank == 1  # the argmax: nothing more likely
    # top-k 5 at temperature 0.5: mass only on the 5, the chosen one among them, no alternatives
    scaled = logits[1] / 0.5
    kept = scaled.topk(5).indices.tolist()
    assert topk.token_id in kept and topk.top == ()
    assert topk.rank == 1 + int((scaled[kept] > scaled[topk.token_id]).sum())  # among the 5 kept
    ref = scaled[kept].log_softmax(-1)[kept.index(topk.token_id)]
    assert math.isclose(topk.logprob, float(ref), rel_tol=1e-5)
    # temperature 2 with a bias: 20 alternatives, sorted, probabilities summing below 1
    biased = logits[3].clone()
    biased[4] += 3.0
    ref_hot = (biased / 2.0).log_softmax(-1)
    assert len(hot.top) == 20 and [v for _, v in hot.top] == sorted((v for _, v in hot.top), reverse=True)
    assert math.isclose(hot.logprob, float(ref_hot[hot.token_id]), rel_tol=1e-5)
    assert sum(math.exp(v) for _, v in hot.top) <= 1.0 + 1e-6
    assert hot.rank == 1 + int((ref_hot > ref_hot[hot.token_id]).sum())


def test_token_ranks_count_the_strictly_more_likely_entries() -> None:
    """vLLM's rank: 1 + the entries with a strictly greater logprob, so tied tokens share the
    best rank of their tie; -inf entries are below everything else."""
    inf = float("-inf")
    logp = torch.tensor(
        [
            [-1.0, -2.0, -2.0, -0.5, inf],
            [-1.0, -1.0, -1.0, -1.0, -1.0],  # all tied: every token rank 1
            [-3.0, -1.0, -2.0, -1.0, inf],
        ]
    )
    chosen = torch.tensor([-2.0, -1.0, inf])
    assert token_ranks(logp, chosen).tolist() == [3, 1, 5]
    everyone = [[int(token_ranks(logp, logp[:, t])[r]) for t in range(5)] for r in range(3)]
    assert everyone == [[2, 3, 3, 1, 5], [1, 1, 1, 1, 1], [4, 1, 3, 1, 5]]


def test_prompt_logprobs_are_the_raw_log_softmax_row_by_row() -> None:
    """Each position's target logprob and top-k of log_softmax(logits), k per row, also across
    the slices a long chunk is computed in."""
    torch.manual_seed(2)
    logits = torch.randn(600, 30) * 3
    targets = [i % 30 for i in range(600)]
    ks = [i % 4 for i in range(600)]
    got = prompt_logprobs(logits, targets, ks)
    want = logits.log_softmax(-1)
    assert [lp.token_id for lp in got] == targets
    for i, lp in enumerate(got):
        assert abs(lp.logprob - float(want[i, targets[i]])) <= 1e-6
        assert [t for t, _ in lp.top] == want[i].topk(ks[i]).indices.tolist()
        assert lp.rank == 1 + int((want[i] > want[i, targets[i]]).sum())
    # each rank in the whole vocabulary, also for a target far outside the top k
    outside = [lp for i, lp in enumerate(got) if lp.rank is not None and lp.rank > ks[i] + 5]
    assert outside and all(lp.token_id not in [t for t, _ in lp.top] for lp in outside)


def test_prompt_logprob_ranks_share_a_tie() -> None:
    """Tied logits (a row of equal values, two equal maxima): the prompt token's rank counts
    only strictly more likely tokens, in the raw distribution (no processor applies)."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 5.0, 5.0, 1.0], [2.0, 5.0, 5.0, 1.0]])
    got = prompt_logprobs(logits, [3, 2, 0], [1, 1, 2])
    assert [lp.rank for lp in got] == [1, 1, 3]


PROMPT = tuple(random.Random(5).randrange(3, 450) for _ in range(29))


def _logprobs(outputs: list[RequestOutput]) -> list[TokenLogprobs]:
    return [lp for o in outputs for lp in o.new_logprobs]


def _assert_close(a: list[TokenLogprobs], b: list[TokenLogprobs]) -> None:
    assert [x.token_id for x in a] == [y.token_id for y in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) <= 1e-5
        assert x.rank == y.rank and x.rank is not None
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert all(abs(u - v) <= 1e-5 for (_, u), (_, v) in zip(x.top, y.top, strict=True))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5, frequency_penalty=0.5),
        SamplingConfig(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2),
    ],
    ids=["greedy", "seeded"],
)
async def test_logprobs_agree_unified_disaggregated_migrated_speculative(
    make_engine: EngineFactory, sampling: SamplingConfig
) -> None:
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    spec = make_engine(speculative="ngram", num_speculative_tokens=3, spec_ngram_min=1, spec_step_cost=False)
    want = await collect(unified.add_request(request("u", PROMPT, sampling)))
    lps = _logprobs(want)
    assert [lp.token_id for lp in lps] == tokens_of(want) and len(lps) == 10
    assert all(len(lp.top) == sampling.logprobs for lp in lps)
    plain = await collect(
        unified.add_request(request("p", PROMPT, dataclasses.replace(sampling, logprobs=None)))
    )
    assert tokens_of(plain) == tokens_of(want) and _logprobs(plain) == []
    first, rest = await handoff_run(prefill, decode, "d", PROMPT, sampling)
    assert len(first.new_logprobs) == 1
    _assert_close(list(first.new_logprobs) + _logprobs(rest), lps)
    moved = dataclasses.replace(sampling, max_tokens=6, first_output_index=4)
    resumed = await collect(unified.add_request(request("m", PROMPT + tuple(tokens_of(want)[:4]), moved)))
    _assert_close(_logprobs(resumed), lps[4:])
    # speculation: a repetitive prompt (and no penalty against repeating) gets proposals accepted;
    # each verified row's logprobs are those plain decoding computes at its index
    loop, looping = PROMPT[:5] * 6, dataclasses.replace(sampling, max_tokens=16, frequency_penalty=0.0)
    on = await collect(spec.add_request(request("s", loop, looping)))
    off = await collect(unified.add_request(request("l", loop, looping)))
    _assert_close(_logprobs(on), _logprobs(off))
    if sampling.temperature == 0.0:  # (random weights: sampled tokens rarely repeat the prompt)
        assert spec.spec_stats(0).num_accepted_tokens > 0


def _assert_prompt_logprobs(
    got: tuple[TokenLogprobs, ...], logp: torch.Tensor, prompt: tuple[int, ...], k: int, tol: float
) -> None:
    """got[i] is prompt token i + 1's logprob under logp[i] (log_softmax at position i)."""
    assert [lp.token_id for lp in got] == list(prompt[1:])
    for i, lp in enumerate(got):
        assert abs(lp.logprob - float(logp[i, prompt[i + 1]])) <= tol
        # the rank in the whole vocabulary, up to ties within tol of the token's logprob
        assert lp.rank is not None
        assert (
            1 + int((logp[i] > lp.logprob + tol).sum())
            <= lp.rank
            <= 1 + int((logp[i] > lp.logprob - tol).sum())
        )
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == logp[i].topk(k).indices.tolist()


async def test_prompt_logprobs_are_the_raw_model_distribution_whatever_the_chunks_cache_and_handoff(
    make_engine: EngineFactory, tiny_bpe: Any
) -> None:
    """Prompt logprobs (echo scoring): the raw model's log_softmax at every prompt position, the
    same in one chunk or many, with the prompt in the prefix cache (it is computed again), on a
    prefill worker (PREFILL_ONLY) as unified; max_tokens 0 generates nothing and ends LENGTH."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([list(PROMPT)])).logits[0].float().log_softmax(-1)
    one_chunk, chunked = make_engine(), make_engine(max_batch_tokens=8)
    score = SamplingConfig(max_tokens=0, temperature=0.0, prompt_logprobs=3)
    (out,) = await collect(one_chunk.add_request(request("a", PROMPT, score)))
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert out.num_generated_tokens == 0 and out.new_token_ids == () and out.text_delta == ""
    _assert_prompt_logprobs(out.prompt_logprobs, ref, PROMPT, 3, 1e-4)
    # many chunks, and the prompt already in that engine's prefix cache: the same values
    await collect(chunked.add_request(request("warm", PROMPT, greedy(2))))
    (cut,) = await collect(chunked.add_request(request("b", PROMPT, score)))
    _assert_close(list(cut.prompt_logprobs), list(out.prompt_logprobs))
    # with generation: prompt logprobs on the first output only, the tokens unchanged
    gen = dataclasses.replace(score, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = await collect(one_chunk.add_request(request("c", PROMPT, gen)))
    plain = await collect(one_chunk.add_request(request("d", PROMPT, greedy(4, ignore_eos=True))))
    assert tokens_of(outs) == tokens_of(plain)
    assert outs[0].prompt_logprobs and all(not o.prompt_logprobs for o in outs[1:])
    _assert_close(list(outs[0].prompt_logprobs), list(out.prompt_logprobs))
    # a prefill worker computes them (with or without generation); max_tokens 0 holds no handoff
    (held,) = await collect(chunked.add_request(request("e", PROMPT, gen, kind=RequestKind.PREFILL_ONLY)))
    _assert_close(list(held.prompt_logprobs), list(out.prompt_logprobs))
    assert held.finish_reason is None and len(held.new_token_ids) == 1
    chunked.release("e")
    with pytest.raises(InvalidArgument, match="max_tokens"):
        one_chunk.add_request(request("f", PROMPT, greedy(0)))
