"""Penalties, logit_bias and min_tokens: the sampler's maths against a per-row reference, rows
independent of their neighbours, and the same tokens unified, disaggregated (the first token on
the prefill engine), after a migration (prompt + generated tokens re-prefilled) and with
speculation on."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from services.worker.engine.api import RequestKind, SamplingConfig
from services.worker.engine.request import Request
from services.worker.engine.sampler import TokenHistory, process_logits, sample
from tests.unit.engine.conftest import EngineFactory, collect, handoff_run, request, tokens_of

VOCAB = 40


def _reference(logits: torch.Tensor, p: SamplingConfig, h: TokenHistory) -> torch.Tensor:
    """One row, written the slow obvious way (vLLM's definitions)."""
    row = logits.clone()
    if h.output_index < p.min_tokens:
        for t in h.min_tokens_stop_ids:
            row[t] = float("-inf")
    for t, b in p.logit_bias:
        row[t] += b
    output = list(h.token_ids)[len(h.token_ids) - h.output_index :]
    for t in set(h.token_ids):
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def _cases() -> list[tuple[SamplingConfig, TokenHistory]]:
    rng = random.Random(3)
    base = SamplingConfig(max_tokens=8, temperature=0.0)
    tokens = [rng.randrange(VOCAB) for _ in range(30)]
    return [
        (base, TokenHistory(tokens, 5)),
        (dataclasses.replace(base, presence_penalty=1.5), TokenHistory(tokens, 12)),
        (dataclasses.replace(base, frequency_penalty=-0.7), TokenHistory(tokens, 30)),
        (dataclasses.replace(base, repetition_penalty=1.8), TokenHistory(tokens[:10], 3)),
        (dataclasses.replace(base, repetition_penalty=0.5, frequency_penalty=2.0), TokenHistory(tokens, 7)),
        (dataclasses.replace(base, logit_bias=((3, 100.0), (7, -100.0), (9, 0.25))), TokenHistory(tokens, 1)),
        (dataclasses.replace(base, min_tokens=4), TokenHistory(tokens, 3, (2, 11))),
        (dataclasses.replace(base, min_tokens=4), TokenHistory(tokens, 4, (2, 11))),
        (
            dataclasses.replace(
                base,
                presence_penalty=0.3,
                frequency_penalty=0.2,
                repetition_penalty=1.2,
                logit_bias=((0, 5.0),),
            ),
            TokenHistory(tokens, 20),
        ),
    ]


def test_processed_logits_match_the_per_row_reference() -> None:
    torch.manual_seed(0)
    cases = _cases()
    logits = torch.randn(len(cases), VOCAB) * 3
    got = process_logits(logits, [p for p, _ in cases], [h for _, h in cases])
    for i, (p, h) in enumerate(cases):
        torch.testing.assert_close(got[i], _reference(logits[i], p, h), rtol=0, atol=1e-6)
        # each row alone gives the same numbers as in the batch (batch-invariant)
        alone = process_logits(logits[i : i + 1], [p], [h])
        assert torch.equal(alone[0], got[i])
    # min_tokens: the stop ids are banned before output index 4, allowed from it on
    assert got[6, 2] == float("-inf") and got[6, 11] == float("-inf")
    assert torch.equal(got[7], logits[7])
    assert torch.equal(logits, logits.clone())  # the input is never written
    # greedy draws follow the processed logits: +100 bias wins, -100 never
    picks = sample(logits, [p for p, _ in cases], [None] * len(cases), histories=[h for _, h in cases])
    assert int(picks[5]) == 3


def test_min_tokens_never_leaves_a_row_without_tokens() -> None:
    """A structured output that may only end (only EOS allowed) ends even before min_tokens."""
    logits = torch.full((2, 6), float("-inf"))
    logits[:, 2] = 0.5  # only EOS (2) left by the grammar mask
    logits[1, 4] = 0.1  # row 1 still has another token
    params = [SamplingConfig(max_tokens=8, temperature=0.0, min_tokens=5)] * 2
    hists = [TokenHistory([1, 3], 1, (2,))] * 2
    got = process_logits(logits, params, hists)
    assert got[0, 2] == 0.5 and got[1, 2] == float("-inf") and got[1, 4] == 0.1


def test_a_migrated_history_counts_its_generated_prompt_tail_as_output() -> None:
    prompt, generated = (5, 6, 7, 8), (9, 9, 6)
    sp = SamplingConfig(max_tokens=10, presence_penalty=1.0)
    unified = Request.from_engine_request(request("u", prompt, sp))
    unified.token_ids.extend(generated)
    migrated_sp = dataclasses.replace(sp, max_tokens=7, first_output_index=3)
    migrated = Request.from_engine_request(request("m", prompt + generated, migrated_sp))
    a, b = unified.token_history(frozenset({2})), migrated.token_history(frozenset({2}))
    assert a is not None and b is not None
    assert a.output_index == b.output_index == 3
    assert list(a.output_token_ids) == list(b.output_token_ids) == list(generated)
    assert (
        Request.from_engine_request(request("x", prompt, SamplingConfig(max_tokens=3))).token_history(
            frozenset()
        )
        is None
    )
    # min_tokens bans EOS (unless ignore_eos) and the stop token ids
    banned = Request.from_engine_request(
        request("y", prompt, SamplingConfig(max_tokens=3, min_tokens=2, stop_token_ids=(7,)))
    ).token_history(frozenset({2}))
    assert banned is not None and banned.min_tokens_stop_ids == (2, 7)
    kept = Request.from_engine_request(
        request("z", prompt, SamplingConfig(max_tokens=3, min_tokens=2, ignore_eos=True))
    ).token_history(frozenset({2}))
    assert kept is not None and kept.min_tokens_stop_ids == ()


PROMPT = tuple(random.Random(11).randrange(3, 450) for _ in range(37))
PENALIZED = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias=((17, 2.0),))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_tokens=14, temperature=0.0, ignore_eos=True, **PENALIZED),  # type: ignore[arg-type]
        SamplingConfig(max_tokens=14, temperature=1.0, top_k=40, seed=5, ignore_eos=True, **PENALIZED),  # type: ignore[arg-type]
    ],
    ids=["greedy", "seeded"],
)
async def test_unified_disaggregated_migrated_and_speculative_agree(
    make_engine: EngineFactory, sampling: SamplingConfig
) -> None:
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    spec = make_engine(speculative="ngram", num_speculative_tokens=3, spec_ngram_min=1, spec_step_cost=False)
    plain = dataclasses.replace(
        sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=()
    )
    want = tokens_of(await collect(unified.add_request(request("u", PROMPT, sampling))))
    assert want != tokens_of(await collect(unified.add_request(request("p", PROMPT, plain))))
    first, rest = await handoff_run(prefill, decode, "d", PROMPT, sampling)
    assert list(first.new_token_ids) + tokens_of(rest) == want
    # a migration after 5 tokens: the generated tokens are prompt now, first_output_index says so
    moved = dataclasses.replace(sampling, max_tokens=9, first_output_index=5)
    resumed = await collect(unified.add_request(request("m", PROMPT + tuple(want[:5]), moved)))
    assert tokens_of(resumed) == want[5:]
    # speculation: rows after a proposal see it in their counts; same tokens
    assert tokens_of(await collect(spec.add_request(request("s", PROMPT, sampling)))) == want
    # and with proposals that were really verified: a prompt that repeats, and no penalties to
    # break the repetition except a mild one (rows after an accepted proposal count it)
    loop = PROMPT[:6] * 6
    mild = dataclasses.replace(sampling, presence_penalty=0.0, frequency_penalty=0.05, repetition_penalty=1.0)
    plain_run = tokens_of(await collect(unified.add_request(request("lu", loop, mild))))
    assert tokens_of(await collect(spec.add_request(request("ls", loop, mild)))) == plain_run
    assert spec.spec_stats(0).num_draft_tokens > 0


async def test_min_tokens_holds_back_eos_then_lets_it_end(make_engine: EngineFactory) -> None:
    """A +100 bias on EOS makes it the greedy choice at once; min_tokens keeps it out until then."""
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    eos = next(iter(unified.eos_token_ids))
    sampling = SamplingConfig(max_tokens=10, temperature=0.0, min_tokens=4, logit_bias=((eos, 100.0),))
    out = await collect(unified.add_request(request("u", PROMPT, sampling)))
    assert out[-1].num_generated_tokens == 4 and out[-1].finish_reason is not None
    assert out[-1].finish_reason.value == "stop"
    assert eos not in tokens_of(out)
    first, rest = await handoff_run(prefill, decode, "d", PROMPT, sampling)
    assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(out)
    assert first.num_generated_tokens + rest[-1].num_generated_tokens == 4
    # without min_tokens the first draw is EOS: nothing generated
    none = await collect(
        unified.add_request(request("n", PROMPT, dataclasses.replace(sampling, min_tokens=0)))
    )
    assert none[-1].num_generated_tokens == 0 and tokens_of(none) == []
    # a PREFILL_ONLY request with min_tokens 1 does not end at its first token
    held = await collect(
        prefill.add_request(
            request("h", PROMPT, dataclasses.replace(sampling, min_tokens=1), kind=RequestKind.PREFILL_ONLY)
        )
    )
    assert held[0].finish_reason is None and held[0].num_generated_tokens == 1
    prefill.release("h")
