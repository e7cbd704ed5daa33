"""vLLM's allowed_token_ids and bad_words: the sampler's masks against a per-row reference (rows
independent of their neighbours, mixed with rows that use neither), their place in vLLM's order
(before min_tokens, logit_bias and the penalties; logprobs of the masked distribution), and the
same tokens unified, disaggregated (the first token on the prefill engine), after a migration and
with n-gram and draft speculation (each verified position masked as if drawn alone)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engine.api import SamplingConfig
from services.worker.engine.sampler import (
    TokenHistory,
    banned_by_bad_words,
    process_logits,
    sample,
    sample_with_logprobs,
)
from shared.errors import InvalidArgument
from tests.unit.engine.conftest import (
    EngineFactory,
    collect,
    drain,
    handoff_run,
    random_prompt,
    request,
    run_all,
    tokens_of,
)

VOCAB = 12


def _reference(row: torch.Tensor, p: SamplingConfig, h: TokenHistory) -> torch.Tensor:
    """One row, the slow obvious way (vLLM's allowed-token mask and bad-words loop)."""
    out = row.clone()
    if p.allowed_token_ids:
        for t in range(VOCAB):
            if t not in p.allowed_token_ids:
                out[t] = float("-inf")
    past = list(h.token_ids)[len(h.token_ids) - h.output_index :]
    for word in p.bad_words:
        if len(word) > len(past) + 1:
            continue
        prefix = list(word[:-1])
        if past[len(past) - len(prefix) :] == prefix or not prefix:
            out[word[-1]] = float("-inf")
    return out


_ids = st.integers(0, VOCAB - 1)
_row = st.tuples(
    st.lists(_ids, max_size=5),  # allowed_token_ids ([] = none)
    st.lists(st.lists(_ids, min_size=1, max_size=3), max_size=4),  # bad words
    st.lists(_ids, max_size=8),  # tokens before the draw
    st.integers(0, 8),  # of which output (the trailing ones)
)


@settings(max_examples=80)
@given(rows=st.lists(_row, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_masks_match_the_per_row_reference(
    rows: list[tuple[list[int], list[list[int]], list[int], int]], seed: int
) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB) * 3
    params = [
        SamplingConfig(
            max_tokens=4,
            temperature=0.0,
            allowed_token_ids=tuple(sorted(set(allowed))),
            bad_words=tuple(tuple(w) for w in bad),
        )
        for allowed, bad, _, _ in rows
    ]
    hists = [TokenHistory(tuple(tokens), min(n, len(tokens))) for _, _, tokens, n in rows]
    got = process_logits(logits, params, hists)
    for i, (p, h) in enumerate(zip(params, hists, strict=True)):
        assert torch.equal(got[i], _reference(logits[i], p, h))
        assert torch.equal(process_logits(logits[i : i + 1], [p], [h])[0], got[i])  # batch-invariant
    assert torch.equal(logits, logits.clone())  # the input is never written


def test_bad_words_ban_only_what_the_output_would_complete() -> None:
    words = ((7,), (1, 2), (3, 4, 5))
    assert banned_by_bad_words(words, ()) == [7]  # a one-token word always; longer ones need output
    assert banned_by_bad_words(words, (9, 1)) == [7, 2]
    assert banned_by_bad_words(words, (1, 3)) == [7]  # 3, 4 not yet: 5 is still allowed
    assert banned_by_bad_words(words, (3, 4)) == [7, 5]
    # the prompt never counts: a prompt ending with 1 leaves 2 allowed at the first draw
    h = TokenHistory((5, 1), 0)
    row = process_logits(torch.zeros(1, VOCAB), [SamplingConfig(max_tokens=1, bad_words=((1, 2),))], [h])
    assert torch.isfinite(row).all()


def test_order_and_logprobs_follow_vllm() -> None:
    """allowed_token_ids comes before logit_bias (a +100 bias cannot bring back a masked token)
    and min_tokens (which then bans the stop token among the allowed); logprobs are those of the
    masked distribution: the allowed tokens hold all the mass."""
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    eos = 2
    params = [
        SamplingConfig(max_tokens=4, temperature=0.0, allowed_token_ids=(4, 6), logit_bias=((9, 100.0),)),
        SamplingConfig(max_tokens=4, temperature=0.0, allowed_token_ids=(eos, 6), min_tokens=3, logprobs=3),
        SamplingConfig(max_tokens=4, temperature=0.7, seed=1, allowed_token_ids=(1, 5, 8), logprobs=4),
    ]
    hists = [TokenHistory((1,), 0), TokenHistory((1,), 0, (eos,)), None]
    seeds = [None, None, 9]
    tokens, lps = sample_with_logprobs(logits, params, [None, None, torch.Generator()], seeds, hists)
    assert int(tokens[0]) in (4, 6) and int(tokens[1]) == 6 and int(tokens[2]) in (1, 5, 8)
    _, only, hot = lps
    assert only is not None and hot is not None
    assert only.logprob == 0.0 and [t for t, _ in only.top[:1]] == [6]  # EOS banned: 6 holds it all
    assert only.top[1][1] == float("-inf")
    ref = (logits[2, [1, 5, 8]] / 0.7).log_softmax(-1)
    assert math.isclose(hot.logprob, float(ref[[1, 5, 8].index(hot.token_id)]), rel_tol=1e-5)
    assert math.isclose(sum(math.exp(v) for _, v in hot.top[:3]), 1.0, rel_tol=1e-5)
    assert hot.top[3][1] == float("-inf")
    # the same draws without logprobs (the plain path)
    again = sample(logits, params, [None, None, torch.Generator()], seeds, hists)
    assert again.tolist() == tokens.tolist()


PROMPT = random_prompt(29, seed=5)


def _constraints(want: list[int]) -> dict[str, SamplingConfig]:
    """Constraints that change an unconstrained run `want`: the bad word is a two-token
    sequence it writes (its 3rd and 4th tokens) and a token it writes later."""
    base = SamplingConfig(max_tokens=14, temperature=0.0, ignore_eos=True)
    allowed = tuple(sorted({want[1], want[5], 40, 41, 300}))
    bad = ((want[2], want[3]), (want[8],))
    return {
        "allowed": dataclasses.replace(base, allowed_token_ids=allowed),
        "bad": dataclasses.replace(base, bad_words=bad),
        "both": dataclasses.replace(base, allowed_token_ids=allowed, bad_words=((want[5],), (40, 41))),
    }


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def _check(tokens: list[int], sp: SamplingConfig) -> None:
    if sp.allowed_token_ids:
        assert set(tokens) <= set(sp.allowed_token_ids)
    for word in sp.bad_words:
        assert not _contains(tokens, word), (word, tokens)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_unified_disaggregated_migrated_and_speculative_agree(
    make_engine: EngineFactory, tiny_bpe: Path, seeded: bool
) -> None:
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    overlapped = make_engine(async_scheduling=True)  # allowed_token_ids alone keeps the overlap
    ngram = make_engine(speculative="ngram", num_speculative_tokens=3, spec_ngram_min=1, spec_step_cost=False)
    draft = make_engine(  # the model as its own draft: it proposes the unconstrained argmax
        speculative="draft", draft_model_path=str(tiny_bpe), num_speculative_tokens=3, spec_step_cost=False
    )
    plain = SamplingConfig(max_tokens=14, temperature=0.0, ignore_eos=True)
    free = tokens_of(await collect(unified.add_request(request("free", PROMPT, plain))))
    constraints = _constraints(free)
    if seeded:
        constraints = {
            k: dataclasses.replace(sp, temperature=1.0, top_k=50, seed=3) for k, sp in constraints.items()
        }
    # all at once, with an unconstrained request in the same steps: each as alone
    together = await drain(
        [unified.add_request(request(f"t-{k}", PROMPT, sp)) for k, sp in constraints.items()]
        + [unified.add_request(request("t-free", PROMPT, plain))]
    )
    assert tokens_of(together[-1]) == free
    for (name, sp), out in zip(constraints.items(), together, strict=False):
        want = tokens_of(await collect(unified.add_request(request(f"u-{name}", PROMPT, sp))))
        assert tokens_of(out) == want
        assert len(want) == 14 and want != free
        _check(want, sp)
        first, rest = await handoff_run(prefill, decode, f"d-{name}", PROMPT, sp)
        assert list(first.new_token_ids) + tokens_of(rest) == want, name
        # a migration after 5 tokens: they are prompt now, first_output_index says they are output
        moved = dataclasses.replace(sp, max_tokens=9, first_output_index=5)
        resumed = await collect(unified.add_request(request(f"m-{name}", PROMPT + tuple(want[:5]), moved)))
        assert tokens_of(resumed) == want[5:], name
        for spec in (ngram, draft, overlapped):
            assert tokens_of(await collect(spec.add_request(request(f"s-{name}", PROMPT, sp)))) == want
    # proposals were really verified against the masks: a repeating prompt (n-gram hits) whose
    # greedy continuation repeats a bad word's first token
    loop = PROMPT[:5] * 6
    looping = tokens_of(await collect(unified.add_request(request("loop", loop, plain))))
    sp = dataclasses.replace(plain, bad_words=((looping[0], looping[1]),), allowed_token_ids=())
    want = tokens_of(await collect(unified.add_request(request("lu", loop, sp))))
    assert want != looping
    _check(want, sp)
    drafted = ngram.spec_stats(0).num_draft_tokens
    # the prefill worker's proposals, handed over with the KV, verified under the masks too
    spec_prefill = make_engine(
        speculative="ngram", num_speculative_tokens=3, spec_ngram_min=1, spec_step_cost=False
    )
    first, rest = await handoff_run(spec_prefill, ngram, "lh", loop, sp)
    assert list(first.new_token_ids) + tokens_of(rest) == want
    assert tokens_of(await collect(ngram.add_request(request("ls", loop, sp)))) == want
    assert ngram.spec_stats(0).num_draft_tokens > drafted
    assert tokens_of(await collect(draft.add_request(request("ld", loop, sp)))) == want


def test_the_engine_refuses_ids_outside_the_vocabulary(make_engine: EngineFactory) -> None:
    engine = make_engine()
    vocab = engine.vocab_size  # type: ignore[attr-defined]
    for sp in (
        SamplingConfig(max_tokens=2, allowed_token_ids=(1, vocab)),
        SamplingConfig(max_tokens=2, bad_words=((1,), (2, vocab))),
        SamplingConfig(max_tokens=2, bad_words=((),)),
    ):
        with pytest.raises(InvalidArgument, match="sampling"):
            engine.add_request(request("r", PROMPT, sp))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_matches_cpu(make_engine: EngineFactory) -> None:
    """The masks on the device (decode graphs and async scheduling on, CUDA's defaults): the same
    logits and tokens as on the CPU."""
    rows = [
        SamplingConfig(max_tokens=4, allowed_token_ids=(1, 3, 7)),
        SamplingConfig(max_tokens=4, bad_words=((2,), (4, 5))),
        SamplingConfig(max_tokens=4),
    ]
    hists = [None, TokenHistory((9, 4), 1), None]
    logits = torch.randn(3, VOCAB)
    assert torch.equal(process_logits(logits.cuda(), rows, hists).cpu(), process_logits(logits, rows, hists))
    cpu, gpu = make_engine(), make_engine(device="cuda")
    plain = SamplingConfig(max_tokens=14, temperature=0.0, ignore_eos=True)
    free = tokens_of(await collect(cpu.add_request(request("free", PROMPT, plain))))
    reqs = [request(name, PROMPT, sp) for name, sp in _constraints(free).items()]
    for a, b in zip(await run_all(cpu, reqs), await run_all(gpu, reqs), strict=True):
        assert tokens_of(b) == tokens_of(a)
