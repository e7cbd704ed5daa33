"""Speculative decoding (ngram): proposer, acceptance, back-off policy and stats in isolation; then
on tiny models, token identity with speculation off (greedy, and seeded sampling: verification
draws each position's (seed, output index) noise) for mixed batches, prefix hits, preemption and
resume, disaggregated and unified; exact accounting when tokens arrive in runs; KV rollback."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.engine.api import (
    Engine,
    EngineRequest,
    RequestHandle,
    RequestOutput,
    SamplingConfig,
)
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request
from services.worker.engine.scheduler import ScheduledRequest, Scheduler
from services.worker.engine.spec import policy
from services.worker.engine.spec.ngram import NgramProposer
from services.worker.engine.spec.policy import SpecRecord
from services.worker.engine.spec.speculation import Speculation
from services.worker.engine.spec.stats import SpecStats
from services.worker.engine.spec.verify import accept_run
from tests.unit.engine.conftest import (
    EngineFactory,
    assert_same_outputs,
    collect,
    greedy,
    handoff_run,
    random_prompt,
    request,
    run_all,
    tokens_of,
)

# every proposal verified (no step-cost model): the identity tests exercise verification fully
SPEC: dict[str, Any] = {"speculative": "ngram", "num_speculative_tokens": 4, "spec_step_cost": False}


def _repetitive(n: int, seed: int) -> tuple[int, ...]:
    """A prompt that repeats a short phrase: n-gram lookup finds matches at once."""
    phrase = random_prompt(7, seed)
    return (phrase * (n // 7 + 1))[:n]


# ---- pieces in isolation ---------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_longest_match() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # most recent "1 2 3"
    assert p.propose([4, 5, 6, 7, 5, 6], 3) == [7, 5, 6]  # the match may run into the suffix
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose([7, 3, 1, 5, 3], 2) == [1, 5]  # falls back to a 1-gram
    assert NgramProposer(2, 3).propose([7, 3, 1, 5, 3], 2) == []  # min_n 2: no match
    assert p.propose([1, 1], 0) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def _scan(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The lookup by definition: the most recent earlier window equal to the suffix, longest n
    first, over the whole sequence."""
    total = len(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = token_ids[total - n :]
        for start in range(total - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=90),
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=1, max_size=40),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 5),
)
def test_ngram_index_grown_step_by_step_equals_a_full_scan(
    prompt: list[int], appends: list[list[int]], min_n: int, extra: int, k: int
) -> None:
    # a request's index follows its token list (a prompt indexed in bulk, then runs of accepted
    # tokens one by one); every proposal equals a scan of the whole sequence, and so does a
    # proposer without the index
    p = NgramProposer(min_n, min_n + extra)
    owner = type("Req", (), {})()
    tokens: list[int] = list(prompt)
    for run in appends:
        tokens.extend(run)
        want = _scan(tokens, k, min_n, min_n + extra) if len(tokens) > min_n else []
        assert p.propose(tokens, k, owner=owner) == want
        assert p.propose(list(tokens), k) == want
    # a sequence that is not an extension of the indexed one is indexed afresh
    other = [t + 1 for t in tokens]
    assert p.propose(other, k, owner=owner) == (
        _scan(other, k, min_n, min_n + extra) if len(other) > min_n else []
    )


def test_accept_run_keeps_the_matching_prefix_and_the_target_token_after_it() -> None:
    assert accept_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch: the target's token
    assert accept_run([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_run([], [4]) == [4]  # no proposals: plain decoding
    with pytest.raises(ValueError):
        accept_run([1, 2], [1, 2])


def test_low_acceptance_backs_off_and_doubles_then_recovers() -> None:
    rec = SpecRecord()
    assert policy.proposal_budget(rec, 4, tokens_left=10, context_left=100) == 4
    assert policy.proposal_budget(rec, 4, tokens_left=3, context_left=100) == 2  # + bonus = 3
    assert policy.proposal_budget(rec, 4, tokens_left=10, context_left=1) == 1
    assert policy.proposal_budget(rec, 4, tokens_left=1, context_left=100) == 0
    for _ in range(4):
        rec = policy.after_verify(rec, 4, 0)
    assert rec.skip_steps == policy.FIRST_BACKOFF_STEPS
    assert policy.proposal_budget(rec, 4, 10, 100) == 0
    while rec.skip_steps:
        rec = policy.after_skipped_step(rec)
    rec = policy.after_verify(rec, 4, 0)  # the probe fails again: twice as long
    assert rec.skip_steps == 2 * policy.FIRST_BACKOFF_STEPS
    rec = dataclass_replace(rec, skip_steps=0)
    rec = policy.after_verify(rec, 4, 4)
    assert rec.backoff_steps == 0 and rec.skip_steps == 0
    assert (rec.num_draft_tokens, rec.num_accepted_tokens) == (24, 4)
    good = SpecRecord()
    for _ in range(20):
        good = policy.after_verify(good, 4, 3)
    assert good.skip_steps == 0 and good.recent_acceptance > 0.7


def dataclass_replace(rec: SpecRecord, **kw: int) -> SpecRecord:
    import dataclasses

    return dataclasses.replace(rec, **kw)


def test_spec_stats_count_per_position() -> None:
    stats = SpecStats()
    stats.record(3, 2)
    stats.record(4, 4)
    stats.record(0, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 6)
    assert stats.accepted_per_position == [2, 2, 1, 1]
    assert stats.acceptance_rate == 6 / 7


def _verifying(sched: Scheduler, max_spec_batch_tokens: int) -> Speculation:
    return Speculation(NgramProposer(2, 4), 5, sched, max_spec_batch_tokens, 1024, vocab_size=512)


def _schedule(sched: Scheduler, spec: Speculation) -> list[ScheduledRequest]:
    """One step's plan with the proposals it verifies."""
    plan = sched.schedule()
    spec.propose(plan)
    return plan.scheduled


def _running(sched: Scheduler, prompt_len: int) -> Request:
    req = Request.from_engine_request(
        EngineRequest("r", tuple(range(prompt_len)), SamplingConfig(max_tokens=50))
    )
    sched.add(req)
    (s,) = sched.schedule().scheduled  # the prompt, sampling the first token
    sched.on_computed(req, s.num_new_tokens)
    req.token_ids.append(1)
    return req


def test_proposals_get_blocks_and_rejected_ones_give_them_back() -> None:
    bm = BlockManager(16, 4, True)
    sched = Scheduler(bm, max_batch_tokens=64, max_num_seqs=4)
    req = _running(sched, 7)  # 8 tokens, 7 computed: 2 blocks
    req.spec_token_ids = [2, 3, 4, 5, 6]
    (s,) = _schedule(sched, _verifying(sched, 64))
    assert (s.num_new_tokens, s.num_draft_tokens) == (1, 5)
    assert len(req.block_ids) == 4  # room for positions up to 12
    # verify: 1 proposal accepted, then the target's own token
    req.token_ids += [2, 9]
    sched.on_computed(req, 2)
    sched.rollback(req)
    assert req.num_computed_tokens == 9 and len(req.block_ids) == 3  # 10 tokens
    assert req.num_hashed_blocks == 2  # only blocks of accepted, computed tokens are cached
    assert bm.num_free_blocks == 16 - 3


def test_proposals_never_preempt_and_respect_the_step_cap() -> None:
    bm = BlockManager(3, 4, False)
    sched = Scheduler(bm, max_batch_tokens=64, max_num_seqs=4)
    req = _running(sched, 7)
    req.spec_token_ids = [2, 3, 4, 5, 6]  # needs 4 blocks in all, the pool has 3... and 1 free
    (s,) = _schedule(sched, _verifying(sched, 64))
    assert s.num_draft_tokens == 0 and req.spec_token_ids == []  # dropped, nothing preempted
    capped = Scheduler(BlockManager(16, 4, False), 64, 4)
    req = _running(capped, 7)
    req.spec_token_ids = [2, 3, 4, 5, 6]
    (s,) = _schedule(capped, _verifying(capped, 3))
    assert s.num_draft_tokens == 2  # 1 token + 2 proposals = the step cap of 3


# ---- on tiny models ---------------------------------------------------------------------------
def _pair(make_engine: EngineFactory, model: Path | None = None, **kw: Any) -> tuple[Engine, Engine]:
    return make_engine(model, **kw), make_engine(model, **SPEC, **kw)


async def test_greedy_mixed_batch_is_token_identical(make_engine: EngineFactory) -> None:
    off, on = _pair(make_engine)
    rng = random.Random(1)
    reqs = []
    for i in range(10):
        prompt = _repetitive(rng.randint(10, 90), i) if i % 2 else random_prompt(rng.randint(3, 90), i)
        reqs.append(request(f"g{i}", prompt, greedy(rng.randint(1, 48), ignore_eos=i % 3 != 0)))
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    stats = on.spec_stats(0)
    assert stats.num_accepted_tokens > 0  # speculation really ran...
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # ...and rejected some
    assert off.spec_stats(0).num_draft_tokens == 0
    load = on.rank_loads()[0]
    assert (load.spec_draft_tokens, load.spec_accepted_tokens) == (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    for engine in (off, on):
        assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


@pytest.mark.parametrize("seed", [3, 2**63 + 11])
async def test_seeded_sampling_is_token_identical(make_engine: EngineFactory, seed: int) -> None:
    off, on = _pair(make_engine)
    reqs = [
        request(
            f"s{i}",
            _repetitive(40, 20 + i),
            SamplingConfig(max_tokens=40, temperature=0.05, top_k=3, seed=seed + i, ignore_eos=True),
        )
        for i in range(4)
    ]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    assert on.spec_stats(0).num_accepted_tokens > 0


async def test_prefix_hits_and_generated_blocks_stay_exact(make_engine: EngineFactory) -> None:
    """A follow-up whose prompt contains a speculating request's output hits the blocks it
    left in the prefix cache and still decodes like a cold engine: no block holds a rejected
    token's K/V."""
    cold, on = make_engine(enable_prefix_caching=False), make_engine(**SPEC)
    prompt = _repetitive(50, 5)
    first = await collect(on.add_request(request("a", prompt, greedy(60, ignore_eos=True))))
    assert on.spec_stats(0).num_draft_tokens > on.spec_stats(0).num_accepted_tokens > 0
    follow = prompt + tuple(tokens_of(first)) + random_prompt(9, 6)
    warm = await collect(on.add_request(request("b", follow, greedy(30, ignore_eos=True))))
    ref = await collect(cold.add_request(request("c", follow, greedy(30, ignore_eos=True))))
    assert warm[-1].num_local_cached_tokens >= 96
    assert_same_outputs(ref, warm)


async def test_preemption_and_resume_are_token_identical(make_engine: EngineFactory) -> None:
    off, on = _pair(make_engine, kv_cache_tokens=160, max_batch_tokens=64)
    reqs = [request(f"p{i}", _repetitive(30, 40 + i), greedy(45, ignore_eos=True)) for i in range(3)]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    assert on.num_preemptions(0) > 0
    assert on.spec_stats(0).num_accepted_tokens > 0
    assert on.num_free_blocks(0) == on.num_total_blocks(0)


@pytest.mark.parametrize("sampled", [False, True])
async def test_disaggregated_with_handoff_proposals_matches_unified(
    make_engine: EngineFactory, sampled: bool
) -> None:
    unified = make_engine()
    # 1-grams, and a prompt holding every token id: whatever the first token, the prefill
    # worker finds it in the prompt and proposes what followed it
    spec = {**SPEC, "spec_ngram_min": 1}
    prefill, decode, plain_decode = make_engine(**spec), make_engine(**spec), make_engine()
    vocab = list(range(3, int(unified.vocab_size)))  # type: ignore[attr-defined]
    random.Random(8).shuffle(vocab)
    prompt = tuple(vocab)
    sampling = (
        SamplingConfig(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
        if sampled
        else greedy(30, ignore_eos=True)
    )
    ref = await collect(unified.add_request(request("u", prompt, sampling)))
    first, rest = await handoff_run(prefill, decode, "d", prompt, sampling)
    assert first.draft_token_ids  # the prefill worker proposed from the prompt
    assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(ref)
    assert rest[-1].num_generated_tokens == 29
    assert decode.spec_stats(0).num_draft_tokens > 0
    # a decode worker that does not speculate ignores the proposals
    first2, rest2 = await handoff_run(prefill, plain_decode, "e", prompt, sampling)
    assert first2.draft_token_ids
    assert list(first2.new_token_ids) + tokens_of(rest2) == tokens_of(ref)
    assert plain_decode.spec_stats(0).num_draft_tokens == 0
    for engine in (prefill, decode, plain_decode):
        assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_runs_end_exactly_where_plain_decoding_ends(make_engine: EngineFactory) -> None:
    """max_tokens, EOS, stop token ids and stop strings falling inside an accepted run end the
    request at exactly the token, text, count and finish_reason of plain decoding."""
    off, on = _pair(make_engine)
    rng = random.Random(4)
    bases = [
        request(f"b{i}", random_prompt(rng.randint(5, 40), 60 + i), greedy(40, ignore_eos=True))
        for i in range(8)
    ]
    reqs: list[EngineRequest] = []
    for i, (req, out) in enumerate(zip(bases, await run_all(off, bases), strict=True)):
        toks = tokens_of(out)
        text = "".join(o.text_delta for o in out)
        j = rng.randrange(5, len(toks))
        variants = [
            greedy(rng.randint(2, 39), ignore_eos=True),
            greedy(40, ignore_eos=True, stop_token_ids=(toks[j],), include_stop_in_output=i % 2 == 0),
            greedy(40, ignore_eos=False),  # EOS may end it
        ]
        if len(text) > 12:
            k = rng.randrange(6, len(text) - 3)
            variants.append(
                greedy(40, ignore_eos=True, stop=(text[k : k + 3],), include_stop_in_output=i % 2 == 1)
            )
        reqs += [request(f"v{i}-{n}", req.prompt_token_ids, v) for n, v in enumerate(variants)]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    assert on.spec_stats(0).num_accepted_tokens > 0
    assert on.num_free_blocks(0) == on.num_total_blocks(0)


# tokens of the byte-fallback model (tests/unit/engine/test_accounting.py)
SMILE = [243, 162, 156, 133]  # <0xF0> <0x9F> <0x99> <0x82> = '🙂'
HELLO = [314, 316, 482]  # '▁', 'he', 'llo'
PATTERN = HELLO + SMILE


@pytest.fixture
def scripted_by_index(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """A sampler that returns script[seed][output index] for seeded rows: the draw seed of each
    row names its output index (Request.draw_seed), so a speculative run and plain decoding get
    the same token at every index. Warm-ups and unseeded rows get token 0."""
    from services.worker.engine import draws
    from services.worker.engine.request import _mix_seed

    scripts: dict[int, list[int]] = {}

    def scripted(logits: Any, params: Any, generators: Any, seeds: Any = None, histories: Any = None) -> Any:
        import torch

        index = {_mix_seed(seed, m): (seed, m) for seed in scripts for m in range(80)}
        out = []
        for i in range(len(params)):
            key = index.get(seeds[i]) if seeds is not None and seeds[i] is not None else None
            out.append(scripts[key[0]][key[1]] if key is not None else 0)
        return torch.tensor(out)

    monkeypatch.setattr(draws, "sample", scripted)
    return scripts


@pytest.mark.parametrize(
    ("max_tokens", "stop", "stop_token_ids", "include", "eos_at"),
    [
        (5, (), (), False, None),
        (13, (), (), False, None),
        (40, ("llo🙂",), (), False, None),
        (40, ("🙂he",), (), True, None),
        (40, (), (SMILE[2],), False, None),
        (40, (), (SMILE[1],), True, None),
        (40, (), (), False, 16),
        (17, (), (), False, 16),
    ],
)
async def test_byte_fallback_runs_are_exact(
    make_engine: EngineFactory,
    tiny_byte_fallback: Path,
    scripted_by_index: dict[int, list[int]],
    max_tokens: int,
    stop: tuple[str, ...],
    stop_token_ids: tuple[int, ...],
    include: bool,
    eos_at: int | None,
) -> None:
    """Characters spanning several byte tokens, stop strings across them, stop tokens, EOS and
    max_tokens inside accepted runs: text, count and finish_reason as without speculation."""
    off, on = _pair(make_engine, tiny_byte_fallback)
    script = PATTERN * 10
    if eos_at is not None:
        script[eos_at] = 2  # <|im_end|>
    scripted_by_index[7] = script
    sp = SamplingConfig(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=7,
        stop=stop,
        stop_token_ids=stop_token_ids,
        include_stop_in_output=include,
        ignore_eos=eos_at is None,
    )
    prompt = (316, 482, *PATTERN, *PATTERN)
    ref = await collect(off.add_request(request("off", prompt, sp)))
    got = await collect(on.add_request(request("on", prompt, sp)))
    assert "🙂" in "".join(o.text_delta for o in ref) or stop or stop_token_ids or max_tokens < 7
    assert_same_outputs(ref, got)
    assert on.spec_stats(0).num_accepted_tokens > 0
    assert on.num_free_blocks(0) == on.num_total_blocks(0)


async def test_500_random_requests_with_cancels_and_speculation_leave_every_pool_full(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(kv_cache_tokens=512, max_batch_tokens=96, max_num_seqs=16, dp_size=2, **SPEC)
    rng = random.Random(3)
    tasks: list[asyncio.Task[list[RequestOutput]]] = []
    handles: list[str] = []
    for i in range(500):
        make = _repetitive if rng.random() < 0.6 else random_prompt
        prompt = make(rng.randint(2, 100), 2000 + rng.randrange(20))  # repeats: cache hits
        sp = (
            greedy(rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
            if rng.random() < 0.7
            else SamplingConfig(max_tokens=rng.randint(1, 24), temperature=1.0, seed=rng.randrange(1000))
        )
        handle: RequestHandle = engine.add_request(request(f"r{i}", prompt, sp, dp_rank=i % 2))
        handles.append(f"r{i}")
        tasks.append(asyncio.ensure_future(collect(handle)))
        if rng.random() < 0.3:
            engine.abort(rng.choice(handles))
        if i % 25 == 0:
            await asyncio.sleep(0.01)
    results = await asyncio.gather(*tasks)
    assert all(r[-1].finished for r in results)
    assert any(r[-1].finish_reason is not None and r[-1].finish_reason.value == "abort" for r in results)
    for rank in range(2):
        assert engine.num_free_blocks(rank) == engine.num_total_blocks(rank)
        assert engine.spec_stats(rank).num_accepted_tokens > 0
    assert [x.num_running + x.num_waiting for x in engine.rank_loads()] == [0, 0]


async def test_a_request_whose_proposals_fail_backs_off(make_engine: EngineFactory) -> None:
    """1-gram lookup over a prompt holding every token id always finds a proposal; sampled
    output rejects nearly all of them: the request stops proposing (doubling back-off), so it
    verifies far fewer than k tokens per step, and its output is unchanged."""
    off, on = _pair(make_engine, spec_ngram_min=1)
    vocab = list(range(3, int(on.vocab_size)))  # type: ignore[attr-defined]
    random.Random(9).shuffle(vocab)
    sp = SamplingConfig(max_tokens=80, temperature=1.0, seed=1, ignore_eos=True)
    ref = await collect(off.add_request(request("a", tuple(vocab), sp)))
    got = await collect(on.add_request(request("b", tuple(vocab), sp)))
    assert_same_outputs(ref, got)
    stats = on.spec_stats(0)
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate < policy.LOW_ACCEPTANCE
    assert stats.num_draft_tokens < 80 * 4 / 4  # without back-off: ~4 per step


async def test_a_large_batch_verifies_no_proposals(make_engine: EngineFactory) -> None:
    """Per-step back-off: with more decoding sequences than spec_max_batch_tokens, verification
    is no longer free and no proposal is scheduled; a lone request still speculates."""
    busy = make_engine(**SPEC, spec_max_batch_tokens=6)
    reqs = [request(f"r{i}", _repetitive(30, 70 + i), greedy(30, ignore_eos=True)) for i in range(8)]
    await run_all(busy, reqs)
    assert busy.spec_stats(0).num_draft_tokens == 0
    await run_all(busy, reqs[:1])
    assert busy.spec_stats(0).num_draft_tokens > 0


@pytest.mark.slow
async def test_smollm2_grounded_rewrite_is_identical_and_accepts(make_engine: EngineFactory) -> None:
    """The default model copying from its prompt: speculation accepts long runs, and the greedy
    output (fp32) is token-identical to plain decoding, in a mixed batch with a small pool
    (preemption) and a second round that hits the prefix cache."""
    from transformers import AutoTokenizer

    from shared.model_store import resolve_model

    path = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(str(path))
    passage = (
        "The Meridian Bridge opened in 1932 after six years of construction. It spans "
        "1,240 metres across the Alder River and carries four lanes of traffic."
    )
    texts = [
        f"Copy this passage exactly:\n\n{passage}",
        "Write a haiku about rivers.",
        f"Replace 1932 with 1933 and output the passage:\n\n{passage}",
    ]
    prompts = [
        tuple(
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
        )
        for t in texts
    ]
    settings: dict[str, Any] = {"model_path": path, "kv_cache_tokens": 256, "max_batch_tokens": 128}
    off, on = make_engine(**settings), make_engine(**settings, **SPEC)
    reqs = [request(f"m{i}", p, greedy(48)) for i, p in enumerate(prompts)]
    for _ in range(2):
        for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
            assert_same_outputs(a, b)
    stats = on.spec_stats(0)
    assert stats.acceptance_rate > 0.5
    assert on.num_free_blocks(0) == on.num_total_blocks(0)
