"""vLLM's thinking_token_budget on the worker: the state machine (count, force, the model closing
by itself, a close tag the model was writing finished rather than repeated) against a slow
reference, the sampler's forcing (one finite logit; logprob 0), and the engine's tokens with a
budget: exactly N thinking tokens then the close sequence, unchanged without a budget, the same
unified, disaggregated (a budget of 0 forces the prefill worker's first token), after a migration
and with n-gram and draft speculation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engine import thinking_budget as tb
from services.worker.engine.api import SamplingConfig
from services.worker.engine.sampler import TokenHistory, sample_with_logprobs
from services.worker.engine.thinking_budget import Phase, ThinkingBudget, ThinkingTracker
from shared.errors import InvalidArgument
from tests.unit.engine.conftest import (
    EngineFactory,
    collect,
    drain,
    handoff_run,
    random_prompt,
    request,
    tokens_of,
)

START, END = (7, 8), (9, 10, 11)


def _reference(budget: ThinkingBudget, output: Sequence[int]) -> int | None:
    """The forced token after `output`, the slow obvious way: replay from scratch."""
    opened = 0 if budget.open_at_start else None
    for n in range(1, len(output) + 1):
        if opened is None and tuple(output[max(0, n - len(START)) : n]) == budget.start_token_ids:
            opened = n
            break
    if opened is None:
        return None
    count = 0
    for n in range(opened, len(output) + 1):
        head = tuple(output[:n])
        if count > 0 and head[-len(END) :] == budget.end_token_ids:
            return None  # closed (by the model or by the forcing)
        if count >= budget.max_tokens:  # spent: the end tag, from what of it the output ends with
            section = head[opened:]
            written = max(
                (k for k in range(len(END)) if k <= len(section) and section[len(section) - k :] == END[:k]),
                default=0,
            )
            if n == len(output):
                return END[written]
            # the next tokens must be the forced ones, so the rest of the replay follows it
            return _after_forcing(budget, output, n, written)
        if n < len(output):
            count += 1
    return None


def _after_forcing(budget: ThinkingBudget, output: Sequence[int], n: int, written: int) -> int | None:
    rest = len(output) - n  # tokens drawn while forcing
    k = written + rest
    return END[k] if k < len(END) else None


_tokens = st.lists(st.sampled_from([1, 2, 7, 8, 9, 10, 11]), max_size=14)


@settings(max_examples=300, deadline=None)
@given(output=_tokens, max_tokens=st.integers(0, 5), open_at_start=st.booleans())
def test_forced_token_matches_the_reference(output: list[int], max_tokens: int, open_at_start: bool) -> None:
    budget = ThinkingBudget(max_tokens, START, END, open_at_start)
    # only outputs that obeyed every forcing so far are reachable
    for n in range(len(output)):
        want = tb.forced_token(budget, tb.advance(budget, tb.initial(budget), output[:n]))
        if want is not None and output[n] != want:
            return
    state = tb.advance(budget, tb.initial(budget), output)
    assert tb.forced_token(budget, state) == _reference(budget, output)
    # incremental (one token at a time, as a request's draws) == at once
    tracker = ThinkingTracker(budget)
    for n in range(len(output) + 1):
        tracker.state(output[:n])
    assert tracker.state(output) == state


def test_budget_counts_after_the_open_tag_then_forces_the_close_tag() -> None:
    budget = ThinkingBudget(2, START, END)
    out: list[int] = [1, 7, 8, 1, 2]  # content, <think>, two thinking tokens
    for want in END:
        assert tb.forced_token(budget, tb.advance(budget, tb.initial(budget), out)) == want
        out.append(want)
    state = tb.advance(budget, tb.initial(budget), [*out, 1, 7, 8, 1, 1, 1])
    assert state.phase is Phase.DONE and tb.forced_token(budget, state) is None  # only the first section
    # the model closing by itself ends the counting
    assert tb.advance(budget, tb.initial(budget), [7, 8, 9, 10, 11, 1, 1, 1]).phase is Phase.DONE
    # a close tag the model was writing when the budget ran out is finished, not repeated
    assert tb.forced_token(budget, tb.advance(budget, tb.initial(budget), [7, 8, 1, 9])) == 10
    assert tb.forced_token(budget, tb.advance(budget, tb.initial(budget), [7, 8, 9])) is None  # 1 < 2
    assert tb.forced_token(budget, tb.advance(budget, tb.initial(budget), [7, 8, 9, 10])) == 11
    # opened by the prompt, a budget of 0: the first draw is forced
    zero = ThinkingBudget(0, START, END, open_at_start=True)
    assert tb.forced_token(zero, tb.initial(zero)) == 9


def test_forced_rows_keep_one_token_with_logprob_zero() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 16)
    budget = ThinkingBudget(0, START, END, open_at_start=True)
    free = SamplingConfig(max_tokens=4, temperature=0.0, logprobs=2)
    forced = dataclasses.replace(free, thinking_budget=budget, temperature=1.0, seed=1)
    hist = TokenHistory((1, 2), 0)
    forced_hist = dataclasses.replace(hist, thinking_budget=budget, thinking=tb.initial(budget))
    gens = [None, torch.Generator().manual_seed(1), None]
    tokens, lps = sample_with_logprobs(logits, [free, forced, free], gens, None, [hist, forced_hist, None])
    assert tokens.tolist() == [int(logits[0].argmax()), 9, int(logits[2].argmax())]
    assert lps[1] is not None and lps[1].logprob == 0.0
    assert lps[1].top[0] == (9, 0.0) and lps[1].top[1][1] == float("-inf")


PROMPT = random_prompt(23, seed=11)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_engine_forces_after_n_thinking_tokens_on_every_path(
    make_engine: EngineFactory, tiny_bpe: Path, seeded: bool
) -> None:
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    ngram = make_engine(speculative="ngram", num_speculative_tokens=3, spec_ngram_min=1, spec_step_cost=False)
    draft = make_engine(
        speculative="draft", draft_model_path=str(tiny_bpe), num_speculative_tokens=3, spec_step_cost=False
    )
    base = SamplingConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
    if seeded:
        base = dataclasses.replace(base, temperature=1.0, top_k=50, seed=3)
    free = tokens_of(await collect(unified.add_request(request("free", PROMPT, base))))
    end = (40, 41, 42)
    assert not set(end) & set(free[:8])
    cases = {  # name: (budget, where thinking opens, budget tokens)
        "open-3": (ThinkingBudget(3, (free[0],), end, open_at_start=True), 0, 3),
        "open-0": (ThinkingBudget(0, (free[0],), end, open_at_start=True), 0, 0),
        "tag-2": (ThinkingBudget(2, (free[1], free[2]), end), 3, 2),
    }
    # all at once with an unbudgeted request in the same steps: each as alone
    together = await drain(
        [
            unified.add_request(request(f"t-{k}", PROMPT, dataclasses.replace(base, thinking_budget=c[0])))
            for k, c in cases.items()
        ]
        + [unified.add_request(request("t-free", PROMPT, base))]
    )
    assert tokens_of(together[-1]) == free
    for (name, (budget, opens, n)), batched in zip(cases.items(), together, strict=False):
        sp = dataclasses.replace(base, thinking_budget=budget)
        want = tokens_of(await collect(unified.add_request(request(f"u-{name}", PROMPT, sp))))
        assert tokens_of(batched) == want, name
        assert want[: opens + n] == free[: opens + n], name  # N thinking tokens as drawn freely
        assert tuple(want[opens + n : opens + n + len(end)]) == end, name  # then the close sequence
        assert len(want) == 16
        first, rest = await handoff_run(prefill, decode, f"d-{name}", PROMPT, sp)
        assert list(first.new_token_ids) + tokens_of(rest) == want, name
        for k in (1, opens + n + 1):  # migrations before and inside the forcing
            moved = dataclasses.replace(sp, max_tokens=16 - k, first_output_index=k)
            resumed = await collect(
                unified.add_request(request(f"m-{name}-{k}", PROMPT + tuple(want[:k]), moved))
            )
            assert tokens_of(resumed) == want[k:], (name, k)
        for spec in (ngram, draft):
            assert tokens_of(await collect(spec.add_request(request(f"s-{name}", PROMPT, sp)))) == want, name
    # the model closing thinking by itself (its 2nd token is the whole end tag) ends the counting
    closing = ThinkingBudget(3, (free[0],), (free[1],), open_at_start=True)
    sp = dataclasses.replace(base, thinking_budget=closing)
    assert tokens_of(await collect(unified.add_request(request("closing", PROMPT, sp)))) == free
    # never opened: unchanged
    never = ThinkingBudget(0, (45, 46), end)
    sp = dataclasses.replace(base, thinking_budget=never)
    if not any(free[i : i + 2] == [45, 46] for i in range(len(free))):
        assert tokens_of(await collect(unified.add_request(request("never", PROMPT, sp)))) == free


def test_the_engine_refuses_tags_outside_the_vocabulary(make_engine: EngineFactory) -> None:
    engine = make_engine()
    vocab = engine.vocab_size  # type: ignore[attr-defined]
    for budget in (ThinkingBudget(1, (1,), (vocab,)), ThinkingBudget(1, (), (2,))):
        with pytest.raises(InvalidArgument, match="thinking_budget"):
            engine.add_request(request("r", PROMPT, SamplingConfig(max_tokens=2, thinking_budget=budget)))
