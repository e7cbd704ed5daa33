"""The per-step back-off of speculation: the step-cost model (fed made-up step times, never a
clock), the per-position acceptance estimate, what an accepted token saves, which proposals a
step verifies, the scheduler applying the plan; then on a tiny model, greedy identity with the
cost model on; the start-up calibration on a fake runner and clock."""

from __future__ import annotations

import random

import pytest

from services.worker.engine.api import EngineRequest, KvLayout, SamplingConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.model_runner import ScheduledSeq
from services.worker.engine.request import Request
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.spec import policy
from services.worker.engine.spec.calibrate import calibrate
from services.worker.engine.spec.ngram import NgramProposer
from services.worker.engine.spec.policy import SpecRecord, StepCost, StepCostModel
from services.worker.engine.spec.speculation import Speculation
from tests.unit.engine.conftest import EngineFactory, drain, greedy, request, tokens_of

# SmolLM2-135M fp32 on one core of the project's 2-core CPU machines (docs/architecture.md)
CPU = StepCost(fixed_ms=23.0, per_seq_ms=2.2, per_token_ms=1.35)
# a step replayed as a CUDA graph: nearly flat in its rows, with a lump when it verifies (every
# sequence padded to k + 1 rows, the proposals checked on the host); made-up, GPU-like figures
GRAPH = StepCost(fixed_ms=3.3, per_seq_ms=0.02, per_token_ms=0.005, verify_ms=1.2)


def test_cost_model_recovers_the_step_time_from_steps_of_different_sizes() -> None:
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(200):
        seqs = rng.randint(1, 8)
        drafts = rng.randint(0, 4 * seqs)
        model.observe(seqs + drafts, seqs, CPU.step_ms(seqs + drafts, seqs) + rng.uniform(-0.5, 0.5))
    got = model.cost
    assert got.fixed_ms == pytest.approx(23.0, abs=0.5)
    assert got.per_seq_ms == pytest.approx(2.2, abs=0.1)
    assert got.per_token_ms == pytest.approx(1.35, abs=0.05)
    assert model.num_observations == 200


def test_cost_model_keeps_its_prior_for_what_the_steps_do_not_show() -> None:
    # steps without proposals say nothing about a proposal's cost: the prior (here: the start-up
    # calibration) keeps it, while the predicted time of such steps follows the steps
    model = StepCostModel(CPU, prior_weight=5.0)
    for _ in range(300):
        for seqs in (2, 8):
            model.observe(seqs, seqs, 40.0 + 5.0 * seqs)
    got = model.cost
    assert got.per_token_ms == pytest.approx(1.35, abs=0.01)
    assert got.step_ms(2, 2) == pytest.approx(50.0, rel=0.05)
    assert got.step_ms(8, 8) == pytest.approx(80.0, rel=0.05)
    # and a fit never makes a cost negative
    neg = StepCostModel()
    for n in range(1, 30):
        neg.observe(2 * n, n, 100.0 - n)
    assert min(neg.cost.fixed_ms, neg.cost.per_seq_ms, neg.cost.per_token_ms) >= 0.0


def test_cost_model_learns_the_lump_of_a_verify_step() -> None:
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(300):
        seqs = rng.randint(1, 8)
        drafts = rng.choice([0, 0, rng.randint(1, 5 * seqs)])
        step = GRAPH.step_ms(seqs + drafts, seqs, verifies=drafts > 0)
        model.observe(seqs + drafts, seqs, step + rng.uniform(-0.05, 0.05))
    got = model.cost
    assert got.verify_ms == pytest.approx(1.2, abs=0.05)
    assert got.fixed_ms == pytest.approx(3.3, abs=0.05)
    assert got.per_token_ms == pytest.approx(0.005, abs=0.003)
    # on the CPU's steps (no lump) the term stays near zero
    cpu = StepCostModel()
    for _ in range(300):
        seqs = rng.randint(1, 8)
        drafts = rng.choice([0, rng.randint(1, 4 * seqs)])
        cpu.observe(seqs + drafts, seqs, CPU.step_ms(seqs + drafts, seqs) + rng.uniform(-0.5, 0.5))
    assert cpu.cost.verify_ms < 0.5
    assert cpu.cost.per_token_ms == pytest.approx(1.35, abs=0.05)


def test_every_step_verifying_keeps_the_priors_split_of_the_lump() -> None:
    # steps that all verify cannot tell the lump from the fixed cost: their sum follows the
    # steps, and the calibrated prior's lump survives instead of melting into `fixed`
    model = StepCostModel(GRAPH, prior_weight=1e-3)
    for _ in range(300):
        for seqs in (4, 8):
            model.observe(6 * seqs, seqs, GRAPH.step_ms(6 * seqs, seqs, verifies=True) + 0.4)
    got = model.cost
    assert got.step_ms(48, 8, verifies=True) == pytest.approx(GRAPH.step_ms(48, 8, True) + 0.4, abs=0.05)
    assert got.verify_ms == pytest.approx(1.2 + 0.2, abs=0.1)


def test_position_acceptance_follows_the_request_history() -> None:
    rec = SpecRecord()
    assert policy.position_acceptance(rec) == policy.PRIOR_ACCEPTANCE
    good = rec
    for _ in range(10):
        good = policy.after_verify(good, 4, 4)  # whole runs accepted: 4 of 4 positions
    assert policy.position_acceptance(good) > 0.9
    bad = rec
    for _ in range(10):
        bad = policy.after_verify(bad, 4, 0)  # rejected at the first position: 0 of 1
    assert policy.position_acceptance(bad) < 0.2
    half = rec
    for _ in range(30):
        half = policy.after_verify(half, 4, 1)  # 1 accepted, then rejected: 1 of 2
    assert policy.position_acceptance(half) == pytest.approx(0.5, abs=0.02)


def test_what_a_token_saves_saturated_and_draining() -> None:
    step = CPU.step_ms(8, 8)
    saturated = policy.token_savings_ms(CPU, 8, [100, 50, 10, 1, 1, 1, 1, 1], saturated=True)
    assert saturated == [pytest.approx(step / 8)] * 8
    # draining: only the requests with the most tokens left end the run; they share the step
    left = [100, 95, 50, 10]
    drain_ms = policy.token_savings_ms(CPU, 4, left, saturated=False)
    share = CPU.step_ms(4, 4) / 2
    assert drain_ms == [pytest.approx(share), pytest.approx(share), CPU.per_seq_ms, CPU.per_seq_ms]
    assert policy.token_savings_ms(CPU, 1, [7], saturated=False) == [pytest.approx(CPU.step_ms(1, 1))]
    assert policy.token_savings_ms(CPU, 0, [], saturated=False) == []


def test_plan_verifies_only_proposals_that_pay_for_themselves() -> None:
    # free verification (an idle accelerator): everything with a chance, up to the room
    assert policy.plan_drafts(0.0, [(4, 0.5, 5.0), (3, 0.0, 5.0)], room=100) == [4, 0]
    assert policy.plan_drafts(0.0, [(4, 0.5, 5.0), (3, 0.9, 5.0)], room=5) == [2, 3]  # best first
    # proposal j is worth a**j * saving: 0.5 * 10 = 5 > 2, 2.5 > 2, 1.25 < 2
    assert policy.plan_drafts(2.0, [(8, 0.5, 10.0)], room=100) == [2]
    # one request alone on the CPU: a step is 25 ms, a proposal 1.35 ms: even a 0.3 chain pays twice
    alone = policy.token_savings_ms(CPU, 1, [100], saturated=False)
    assert policy.plan_drafts(CPU.per_token_ms, [(8, 0.3, alone[0])], room=100) == [2]
    assert policy.plan_drafts(CPU.per_token_ms, [(8, 0.9, alone[0])], room=100) == [8]
    # eight requests draining together on the CPU: a low-acceptance request verifies nothing, a
    # request that already ran ahead of the others (not critical) needs a near-sure proposal
    left = [100] * 7 + [60]
    savings = policy.token_savings_ms(CPU, 8, left, saturated=False)
    offers = [(8, 0.2, savings[0]), (8, 0.8, savings[1]), (8, 0.5, savings[7])]
    assert policy.plan_drafts(CPU.per_token_ms, offers, room=100) == [0, 6, 0]
    # no room, no proposals
    assert policy.plan_drafts(0.0, [(4, 0.9, 5.0)], room=0) == [0]


def test_plan_verifies_nothing_when_the_proposals_do_not_pay_for_the_verify_step() -> None:
    # eight requests on a GPU-like rank, saturated: an accepted token saves its share of a step
    savings = policy.token_savings_ms(GRAPH, 8, [100] * 8, saturated=True)
    low = [(5, 0.25, savings[0])] * 8  # open-ended chat: a quarter of the proposals accepted
    # per proposal alone the first three pay (0.25**3 * 0.43 ms > 0.005 ms) ...
    assert policy.plan_drafts(GRAPH.per_token_ms, low, room=100) == [3] * 8
    # ... but together they are expected to save ~1.0 ms: less than the 1.2 ms lump
    assert policy.plan_drafts(GRAPH.per_token_ms, low, room=100, verify_ms=GRAPH.verify_ms) == [0] * 8
    high = [(5, 0.8, savings[0])] * 8  # grounded: most proposals accepted
    assert policy.plan_drafts(GRAPH.per_token_ms, high, room=100, verify_ms=GRAPH.verify_ms) == [5] * 8
    # one valuable request carries the step for the rest, whose proposals then ride along
    mixed = [(5, 0.95, savings[0]), *low[1:]]
    got = policy.plan_drafts(GRAPH.per_token_ms, mixed, room=100, verify_ms=GRAPH.verify_ms)
    assert got[0] == 5 and all(n > 0 for n in got[1:])


def _decoding(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 50) -> Request:
    req = Request.from_engine_request(
        EngineRequest(rid, tuple(range(3, 3 + prompt_len)), SamplingConfig(max_tokens=max_tokens))
    )
    sched.add(req)
    return req


def _start(sched: Scheduler, reqs: list[Request]) -> None:
    for s in sched.schedule().scheduled:  # the prompts, sampling each first token
        sched.on_computed(s.request, s.num_new_tokens)
        s.request.token_ids.append(1)
    assert all(r.is_decoding for r in reqs)


def test_speculation_applies_the_cost_plan() -> None:
    sched = Scheduler(BlockManager(64, 4, False), max_batch_tokens=256, max_num_seqs=8)
    spec = Speculation(NgramProposer(2, 4), 4, sched, 256, max_model_len=1024, vocab_size=512)
    reqs = [_decoding(sched, f"r{i}", 7) for i in range(4)]
    _start(sched, reqs)
    good = SpecRecord()
    for _ in range(10):
        good = policy.after_verify(good, 4, 4)
    reqs[0].spec = good  # accepts whole runs; the others have no history (prior 0.5)
    for r in reqs:
        r.spec_token_ids = [5, 6, 7, 8]
    spec.step_cost = StepCostModel(StepCost(fixed_ms=20.0, per_seq_ms=2.0, per_token_ms=3.0))
    plan = sched.schedule()
    spec.propose(plan)
    planned = {s.request.request_id: s.num_draft_tokens for s in plan.scheduled}
    # a step of 4 is 28 ms, 7 ms per request: the good one's 4 proposals pay (0.9**4 * 7 > 3), a
    # prior-0.5 request's first pays (3.5 > 3) and its second does not (1.75)
    assert planned == {"r0": 4, "r1": 1, "r2": 1, "r3": 1}
    assert [len(r.spec_token_ids) for r in reqs] == [4, 4, 4, 4]  # proposals kept for the verify


def test_speculation_drops_proposals_that_do_not_pay() -> None:
    sched = Scheduler(BlockManager(64, 4, False), max_batch_tokens=256, max_num_seqs=8)
    spec = Speculation(NgramProposer(2, 4), 4, sched, 256, max_model_len=1024, vocab_size=512)
    reqs = [_decoding(sched, f"r{i}", 7) for i in range(2)]
    _start(sched, reqs)
    for r in reqs:
        r.spec_token_ids = [5, 6, 7]
    spec.step_cost = StepCostModel(StepCost(fixed_ms=1.0, per_seq_ms=1.0, per_token_ms=50.0))
    plan = sched.schedule()
    spec.propose(plan)
    assert [s.num_draft_tokens for s in plan.scheduled] == [0, 0]
    assert [r.spec_token_ids for r in reqs] == [[], []]  # dropped: proposed again after the step


async def test_cost_model_on_keeps_greedy_identity_and_calibrates(make_engine: EngineFactory) -> None:
    off = make_engine()
    on = make_engine(speculative="ngram", num_speculative_tokens=4, spec_ngram_min=1)
    rank = on._ranks[0]  # type: ignore[attr-defined]
    cost = rank.speculation.step_cost
    assert cost is not None and cost.prior != StepCostModel().prior  # calibrated at start-up
    rng = random.Random(3)
    reqs = []
    for i in range(6):
        phrase = tuple(rng.randrange(3, 450) for _ in range(5))
        reqs.append(request(f"c{i}", (phrase * 12)[: rng.randint(20, 60)], greedy(24, ignore_eos=True)))
    want = await drain([off.add_request(r) for r in reqs])
    got = await drain([on.add_request(r) for r in reqs])
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in want]
    assert cost.num_observations > 0  # decode steps taught it


class _FakeRunner:
    """Executes nothing; each step advances a fake clock by `cost` of its shape."""

    def __init__(self, cost: StepCost = CPU) -> None:
        self.cost = cost
        self.now_ns = 0
        self.layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=16, dtype="float32")
        self.shapes: list[tuple[int, int]] = []

    def execute(self, seqs: list[ScheduledSeq]) -> list[list[int]]:
        tokens = sum(len(s.token_ids) for s in seqs)
        self.shapes.append((len(seqs), tokens))
        self.now_ns += int(self.cost.step_ms(tokens, len(seqs), verifies=tokens > len(seqs)) * 1e6)
        return [[0] * s.num_logits for s in seqs]


def test_calibration_fits_dummy_steps_of_several_shapes() -> None:
    runner = _FakeRunner()
    got = calibrate(runner, max_drafts=8, clock=(lambda: runner.now_ns, lambda: None))
    assert got.fixed_ms == pytest.approx(CPU.fixed_ms, abs=0.05)
    assert got.per_seq_ms == pytest.approx(CPU.per_seq_ms, abs=0.01)
    assert got.per_token_ms == pytest.approx(CPU.per_token_ms, abs=0.01)
    assert {n for n, _ in runner.shapes} == {1, 4, 8}  # batch sizes and proposal counts vary
    assert len({t - n for n, t in runner.shapes}) > 2
    assert got.verify_ms == pytest.approx(0.0, abs=0.01)
    # a rank whose verify steps cost a lump (CUDA graphs) has it measured before any request
    runner = _FakeRunner(GRAPH)
    got = calibrate(runner, max_drafts=5, clock=(lambda: runner.now_ns, lambda: None))
    assert got.terms() == pytest.approx(GRAPH.terms(), abs=0.01)
    # proposals beyond k are never timed
    runner = _FakeRunner()
    calibrate(runner, max_drafts=2, clock=(lambda: runner.now_ns, lambda: None))
    assert max(t // n for n, t in runner.shapes) == 3
