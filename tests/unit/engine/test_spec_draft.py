"""Draft-model speculation (spec/draft.py) on tiny models: the draft's KV rollback in isolation;
then token identity with speculation off (greedy fp32, and seeded sampling) for mixed batches with
chunked prefill, prefix hits, preemption and resume, disaggregated and unified; a draft equal to
the target accepts (nearly) everything; both KV pools full after random requests with cancels; a
draft with another tokenizer or no model at all is refused at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine.api import (
    Engine,
    EngineRequest,
    RequestKind,
    RequestOutput,
    SamplingConfig,
)
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.request import Request
from services.worker.engine.spec.draft import DraftProposer
from shared.errors import InvalidArgument, NotFound
from tests.support.tiny_models import build_tiny_draft
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


@pytest.fixture(scope="session")
def tiny_draft(tiny_bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's first layer (of 2) with its tokenizer: agrees with it about a third of the
    time on random prompts, so runs are both accepted and rejected."""
    return build_tiny_draft(tiny_bpe, tmp_path_factory.mktemp("tiny_draft"), num_layers=1)


def _spec(draft: Path, **kw: Any) -> dict[str, Any]:
    # every proposal verified (no step-cost model, which on a tiny model may find verification
    # too dear): these tests count proposals and acceptance
    return {
        "speculative": "draft",
        "draft_model_path": str(draft),
        "num_speculative_tokens": 4,
        "spec_step_cost": False,
        **kw,
    }


def _draft_pool_full(engine: Engine, rank: int = 0) -> bool:
    free, total = engine.draft_blocks(rank)  # type: ignore[attr-defined]
    return bool(total) and free == total


def _pools_full(engine: Engine, rank: int = 0) -> bool:
    return engine.num_free_blocks(rank) == engine.num_total_blocks(rank) and _draft_pool_full(engine, rank)


# ---- the draft's KV bookkeeping in isolation -------------------------------------------------
def _bookkeeping_only(blocks: BlockManager, max_catchup_tokens: int) -> DraftProposer:
    """plan/apply only (no forward pass: no runner)."""
    runner: Any = None
    return DraftProposer(runner, blocks, max_catchup_tokens, max_model_len=100, vocab_size=500)


def test_plan_rolls_the_draft_kv_back_to_the_accepted_tokens() -> None:
    """After a round that fed proposals [5, 6, 7] past 10 tokens, the target accepted 5 and 6
    and added its own 9: the draft keeps K/V for 12 tokens, feeds 9, and frees the blocks only
    rejected proposals used."""
    blocks = BlockManager(8, 4, False)
    proposer = _bookkeeping_only(blocks, max_catchup_tokens=64)
    req = Request.from_engine_request(EngineRequest("r", tuple(range(10, 20)), SamplingConfig(max_tokens=50)))
    (job,) = proposer.plan([(req, 4)])
    assert (job.start_pos, job.token_ids, job.num_proposals) == (0, list(range(10, 20)), 4)
    assert len(job.block_ids) == 4  # 10 tokens + 3 fed proposals = 13 positions
    job.proposals = [5, 6, 7, 8]
    assert proposer.apply([job]) == {req: [5, 6, 7, 8]}
    req.token_ids += [5, 6, 9]  # verification: 2 accepted + the target's token
    (job,) = proposer.plan([(req, 1)])
    assert (job.start_pos, job.token_ids, job.num_proposals) == (12, [9], 1)
    assert len(job.block_ids) == 4 and blocks.num_free_blocks == 4  # 13 positions
    job.proposals = [3]
    proposer.apply([job])
    req.token_ids += [4]  # rejected: the draft keeps 13 tokens and feeds 4
    (job,) = proposer.plan([(req, 2)])
    assert (job.start_pos, job.token_ids) == (13, [4])
    job.proposals = [600, 1]  # an id the target cannot embed ends the run
    assert proposer.apply([job]) == {req: []}
    proposer.drop(req)
    assert blocks.num_free_blocks == 8 and proposer.num_states == 0


def test_plan_catches_up_in_budgeted_chunks_and_never_takes_what_the_pool_lacks() -> None:
    blocks = BlockManager(4, 4, False)
    proposer = _bookkeeping_only(blocks, max_catchup_tokens=6)
    a = Request.from_engine_request(EngineRequest("a", tuple(range(9)), SamplingConfig(max_tokens=50)))
    b = Request.from_engine_request(EngineRequest("b", tuple(range(3)), SamplingConfig(max_tokens=50)))
    (job,) = proposer.plan([(a, 4), (b, 4)])  # a takes the whole budget, b waits
    assert (job.request, job.token_ids, job.num_proposals) == (a, list(range(6)), 0)
    proposer.apply([job])
    jobs = proposer.plan([(a, 4)])  # 3 left to catch up, then 4 proposals: 12 positions = 3 blocks
    assert (jobs[0].start_pos, jobs[0].num_proposals, len(jobs[0].block_ids)) == (6, 4, 3)
    proposer.apply(jobs)
    assert proposer.plan([(b, 4)]) == []  # 1 free block, b needs 2: no proposals, no preemption
    assert blocks.num_free_blocks == 1


def _proposer(model_path: Path, num_blocks: int = 48, prefix_caching: bool = False) -> DraftProposer:
    import torch

    from services.worker.engine.model_loading import kv_layout_of, load_model
    from services.worker.engine.model_runner import ModelRunner

    cpu = torch.device("cpu")
    model = load_model(str(model_path), cpu, torch.float32)
    runner = ModelRunner(model, kv_layout_of(model.config, 4, torch.float32), num_blocks, cpu, torch.float32)
    blocks = BlockManager(num_blocks, 4, prefix_caching)
    return DraftProposer(runner, blocks, 64, 2048, int(model.config.vocab_size))


def _round(proposer: DraftProposer, req: Request, k: int) -> list[int]:
    jobs = proposer.plan([(req, k)])
    proposer.run(jobs)
    return proposer.apply(jobs).get(req, [])


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_draft_kv_follows_the_accepted_tokens_exactly(tiny_draft: Path, prefix_caching: bool) -> None:
    """Rounds of proposals against random verdicts (a random number accepted, then a random
    target token): every round proposes what a fresh draft, prefilling the same tokens, would
    (with prefix caching, the fresh one starts from the blocks its earlier rounds cached)."""
    kept, fresh = (
        _proposer(tiny_draft, prefix_caching=prefix_caching),
        _proposer(tiny_draft, prefix_caching=prefix_caching),
    )
    rng = random.Random(2)
    req = Request.from_engine_request(
        EngineRequest("r", random_prompt(11, 1), SamplingConfig(max_tokens=500))
    )
    for i in range(12):
        props = _round(kept, req, 3)
        twin = Request.from_engine_request(
            EngineRequest(f"t{i}", tuple(req.token_ids), SamplingConfig(max_tokens=9))
        )
        assert props == _round(fresh, twin, 3)
        fresh.drop(twin)
        req.token_ids += [*props[: rng.randint(0, 3)], rng.randrange(3, 450)]
    kept.drop(req)
    assert kept.blocks.num_free_blocks == kept.blocks.num_blocks
    assert fresh.blocks.num_free_blocks == fresh.blocks.num_blocks


# ---- on tiny models ---------------------------------------------------------------------------
async def test_greedy_mixed_batch_with_chunked_prefill_is_token_identical(
    make_engine: EngineFactory, tiny_draft: Path
) -> None:
    settings: dict[str, Any] = {"max_batch_tokens": 64}  # prompts up to 150: chunked, both models
    off, on = make_engine(**settings), make_engine(**settings, **_spec(tiny_draft))
    rng = random.Random(1)
    reqs = [
        request(
            f"g{i}", random_prompt(rng.randint(3, 150), i), greedy(rng.randint(1, 40), ignore_eos=i % 3 != 0)
        )
        for i in range(10)
    ]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    stats = on.spec_stats(0)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected runs
    assert on.rank_loads()[0].spec_accepted_tokens == stats.num_accepted_tokens
    assert _pools_full(on)


async def test_a_draft_equal_to_the_target_is_accepted(make_engine: EngineFactory, tiny_bpe: Path) -> None:
    """Same weights: every greedy proposal is what the target samples (so the draft really
    follows the accepted tokens: a draft KV one token off would propose garbage)."""
    off, on = make_engine(), make_engine(**_spec(tiny_bpe))
    reqs = [
        request(f"e{i}", random_prompt(20 + 9 * i, 30 + i), greedy(30, ignore_eos=True)) for i in range(4)
    ]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    stats = on.spec_stats(0)
    assert stats.num_draft_tokens >= 4 * 20  # ~ k per step
    assert stats.acceptance_rate >= 0.95
    assert _pools_full(on)


async def test_seeded_sampling_is_reproducible_and_identical(
    make_engine: EngineFactory, tiny_bpe: Path
) -> None:
    """Greedy draft proposals against seeded samples: each verified position draws its (seed,
    output index) noise, so output equals plain decoding and repeats run to run."""
    off, on = make_engine(), make_engine(**_spec(tiny_bpe))
    reqs = [
        request(
            f"s{i}",
            random_prompt(30, 50 + i),
            SamplingConfig(max_tokens=40, temperature=0.3, top_k=5, seed=7 + i, ignore_eos=True),
        )
        for i in range(4)
    ]
    ref = await run_all(off, reqs)
    for _ in range(2):
        for a, b in zip(ref, await run_all(on, reqs), strict=True):
            assert_same_outputs(a, b)
    stats = on.spec_stats(0)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _pools_full(on)


async def test_prefix_hits_on_both_pools_stay_exact(
    make_engine: EngineFactory, tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follow-up hits the target's prefix cache (its output blocks included) and the draft's
    own: the draft computes only the new tail, proposes as well as on a cold prompt, and the
    output equals a cold engine's."""
    computed: list[int] = []
    run = DraftProposer.run

    def counting(self: DraftProposer, jobs: Any) -> None:
        computed.extend(len(j.token_ids) for j in jobs)
        run(self, jobs)

    monkeypatch.setattr(DraftProposer, "run", counting)
    cold, on = make_engine(enable_prefix_caching=False), make_engine(**_spec(tiny_bpe))
    prompt = random_prompt(50, 5)
    first = await collect(on.add_request(request("a", prompt, greedy(40, ignore_eos=True))))
    follow = prompt + tuple(tokens_of(first)) + random_prompt(9, 6)
    drafted = on.spec_stats(0).num_draft_tokens
    computed.clear()
    warm = await collect(on.add_request(request("b", follow, greedy(30, ignore_eos=True))))
    ref = await collect(cold.add_request(request("c", follow, greedy(30, ignore_eos=True))))
    assert warm[-1].num_local_cached_tokens >= 80
    assert_same_outputs(ref, warm)
    assert computed[0] <= 9 + 16  # the draft's first catch-up: the new tail, not 99 tokens
    assert sum(computed) < len(follow)
    stats = on.spec_stats(0)
    assert stats.num_draft_tokens - drafted >= 20 and stats.acceptance_rate >= 0.95
    assert _pools_full(on)


async def test_preemption_and_resume_are_token_identical(
    make_engine: EngineFactory, tiny_draft: Path
) -> None:
    settings: dict[str, Any] = {"kv_cache_tokens": 160, "max_batch_tokens": 64}
    off, on = make_engine(**settings), make_engine(**settings, **_spec(tiny_draft))
    reqs = [request(f"p{i}", random_prompt(30, 40 + i), greedy(45, ignore_eos=True)) for i in range(3)]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    assert on.num_preemptions(0) > 0
    assert on.spec_stats(0).num_accepted_tokens > 0
    assert _pools_full(on)


@pytest.mark.parametrize("sampled", [False, True])
async def test_disaggregated_with_draft_handoff_proposals_matches_unified(
    make_engine: EngineFactory, tiny_bpe: Path, tiny_draft: Path, sampled: bool
) -> None:
    """The prefill worker's draft model proposes the first run (draft_token_ids); the decode
    worker verifies it at its first step and drafts on from there (its own draft prefills the
    imported prompt lazily); a non-speculating decode worker ignores the proposals."""
    unified = make_engine()
    prefill, decode, plain = make_engine(**_spec(tiny_bpe)), make_engine(**_spec(tiny_draft)), make_engine()
    prompt = random_prompt(70, 8)
    sampling = (
        SamplingConfig(max_tokens=30, temperature=0.5, seed=5, ignore_eos=True)
        if sampled
        else greedy(30, ignore_eos=True)
    )
    ref = await collect(unified.add_request(request("u", prompt, sampling)))
    first, rest = await handoff_run(prefill, decode, "d", prompt, sampling)
    assert len(first.draft_token_ids) == 4
    assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(ref)
    assert rest[-1].num_generated_tokens == 29
    assert decode.spec_stats(0).num_draft_tokens > 0
    if not sampled:  # the prefill side's draft equals the target: its run is the output
        assert list(first.draft_token_ids) == tokens_of(ref)[1:5]
        accepted = decode.spec_stats(0).accepted_per_position
        assert len(accepted) >= 4 and min(accepted[:4]) >= 1
    first2, rest2 = await handoff_run(prefill, plain, "e", prompt, sampling)
    assert first2.draft_token_ids
    assert list(first2.new_token_ids) + tokens_of(rest2) == tokens_of(ref)
    assert plain.spec_stats(0).num_draft_tokens == 0
    for engine in (prefill, decode):
        assert _pools_full(engine)
    assert plain.num_free_blocks(0) == plain.num_total_blocks(0)


async def test_random_requests_with_cancels_leave_both_pools_full(
    make_engine: EngineFactory, tiny_draft: Path
) -> None:
    engine = make_engine(
        kv_cache_tokens=512,
        max_batch_tokens=96,
        max_num_seqs=16,
        dp_size=2,
        **_spec(tiny_draft, draft_kv_cache_tokens=384),
    )
    rng = random.Random(3)
    tasks: list[asyncio.Task[list[RequestOutput]]] = []
    ids: list[str] = []

    async def run(req: EngineRequest) -> list[RequestOutput]:
        outs = await collect(engine.add_request(req))
        if req.kind is RequestKind.PREFILL_ONLY:
            with contextlib.suppress(NotFound, InvalidArgument):  # aborted meanwhile
                engine.release(req.request_id)  # as the worker does after the KV export
        return outs

    for i in range(300):
        kind = RequestKind.PREFILL_ONLY if rng.random() < 0.1 else RequestKind.FULL
        prompt = random_prompt(rng.randint(2, 100), 2000 + rng.randrange(20))  # repeats: cache hits
        sp = (
            greedy(rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
            if rng.random() < 0.7
            else SamplingConfig(max_tokens=rng.randint(1, 24), temperature=1.0, seed=rng.randrange(1000))
        )
        rid = f"r{i}"
        tasks.append(asyncio.ensure_future(run(request(rid, prompt, sp, kind, i % 2))))
        ids.append(rid)
        if rng.random() < 0.3:
            engine.abort(rng.choice(ids))
        if i % 25 == 0:
            await asyncio.sleep(0.01)
    results = await asyncio.gather(*tasks)
    assert all(r[-1].finished for r in results)
    assert any(r[-1].finish_reason is not None and r[-1].finish_reason.value == "abort" for r in results)
    for rank in range(2):
        assert engine.num_free_blocks(rank) == engine.num_total_blocks(rank)
        assert _draft_pool_full(engine, rank)
        assert engine.spec_stats(rank).num_accepted_tokens > 0
    assert [x.num_running + x.num_waiting for x in engine.rank_loads()] == [0, 0]


async def test_a_large_batch_runs_no_draft_passes_for_proposals(
    make_engine: EngineFactory, tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-step back-off: with more running requests than spec_max_batch_tokens the next step
    could verify no proposal, so the draft model does not propose any; a lone request does."""
    wanted: list[int] = []
    run = DraftProposer.run

    def counting(self: DraftProposer, jobs: Any) -> None:
        wanted.extend(j.num_proposals for j in jobs)
        run(self, jobs)

    monkeypatch.setattr(DraftProposer, "run", counting)
    busy = make_engine(**_spec(tiny_bpe, spec_max_batch_tokens=6))
    reqs = [request(f"r{i}", random_prompt(30, 70 + i), greedy(30, ignore_eos=True)) for i in range(8)]
    await run_all(busy, reqs)
    assert busy.spec_stats(0).num_draft_tokens == 0 and sum(wanted) == 0
    await run_all(busy, reqs[:1])
    assert busy.spec_stats(0).num_draft_tokens > 0 and sum(wanted) > 0
    assert _pools_full(busy)


async def test_a_failing_draft_model_proposes_nothing_and_fails_no_request(
    make_engine: EngineFactory, tiny_bpe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: DraftProposer, jobs: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(DraftProposer, "run", boom)
    off, on = make_engine(), make_engine(**_spec(tiny_bpe))
    sp = greedy(12, ignore_eos=True)
    ref = await collect(off.add_request(request("a", random_prompt(20, 1), sp)))
    assert_same_outputs(ref, await collect(on.add_request(request("b", random_prompt(20, 1), sp))))
    (first,) = await collect(
        on.add_request(request("c", random_prompt(20, 1), sp, kind=RequestKind.PREFILL_ONLY))
    )
    assert first.finished and first.draft_token_ids == () and first.new_token_ids == tuple(tokens_of(ref)[:1])
    on.release("c")
    assert on.spec_stats(0).num_draft_tokens == 0
    assert _pools_full(on)


def test_the_default_pools_share_the_memory_budget(
    make_engine: EngineFactory, tiny_bpe: Path, tiny_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without kv_cache_tokens the target's pool takes its share of free memory; with a draft
    whose pool follows it, that share covers both (token for token)."""
    from services.worker.engine import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 64 << 20)
    settings: dict[str, Any] = {"kv_cache_tokens": 0, "max_num_seqs": 1000}
    alone, paired = make_engine(**settings), make_engine(**settings, **_spec(tiny_draft))
    sized = make_engine(**settings, **_spec(tiny_draft, draft_kv_cache_tokens=100))
    # per token: target 2 layers x 2 x 2 heads x 16 x 4 B = 512 B; draft (1 layer) 256 B
    assert paired.num_total_blocks(0) == alone.num_total_blocks(0) * 2 // 3
    assert paired.draft_blocks(0)[1] == paired.num_total_blocks(0)  # type: ignore[attr-defined]
    assert sized.num_total_blocks(0) == alone.num_total_blocks(0)
    assert sized.draft_blocks(0)[1] == -(-100 // 16)  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_draft_speculation_matches_cpu(make_engine: EngineFactory, tiny_draft: Path) -> None:
    cpu, gpu = make_engine(), make_engine(device="cuda", **_spec(tiny_draft))
    reqs = [
        request(f"c{i}", random_prompt(20 + 13 * i, 80 + i), greedy(24, ignore_eos=True)) for i in range(4)
    ]
    for a, b in zip(await run_all(cpu, reqs), await run_all(gpu, reqs), strict=True):
        assert tokens_of(b) == tokens_of(a)
    assert gpu.spec_stats(0).num_accepted_tokens > 0
    assert _pools_full(gpu)


# ---- start-up refusals ------------------------------------------------------------------------
def test_a_draft_with_another_tokenizer_is_refused(
    make_engine: EngineFactory, tiny_byte_fallback: Path
) -> None:
    with pytest.raises(InvalidArgument, match="does not share the target's tokenizer"):
        make_engine(**_spec(tiny_byte_fallback))


def test_a_draft_that_is_no_model_is_refused(make_engine: EngineFactory, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot load draft model"):
        make_engine(**_spec(tmp_path))
    with pytest.raises(InvalidArgument, match="needs a draft model"):
        make_engine(speculative="draft")


@pytest.mark.slow
async def test_smollm2_as_its_own_draft_accepts_everything(make_engine: EngineFactory) -> None:
    """The default model as its own draft (there is no smaller model with its tokenizer here):
    greedy output unchanged, nearly every proposal accepted."""
    from shared.model_store import resolve_model

    path = resolve_model("default")
    settings: dict[str, Any] = {"model_path": path, "kv_cache_tokens": 256}
    off, on = make_engine(**settings), make_engine(**settings, **_spec(path))
    reqs = [request(f"m{i}", random_prompt(40, 90 + i), greedy(12)) for i in range(2)]
    for a, b in zip(await run_all(off, reqs), await run_all(on, reqs), strict=True):
        assert_same_outputs(a, b)
    assert on.spec_stats(0).acceptance_rate >= 0.9
    assert _pools_full(on)
