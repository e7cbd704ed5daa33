"""(a) The simulated disaggregated cluster: one trace replayed per routing policy against N
prefill x D ranks and N decode x D ranks (see bench_sched's docstring for the model), printed as a
table, and the same comparison on other seeds and at other loads."""

from __future__ import annotations

import heapq
import random
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from benchmarks.sched.config import SIM_POLICIES, SimConfig, TraceRequest, make_trace
from services.scheduler import policies
from services.scheduler.reservations import Reservations


@dataclass(frozen=True)
class SimResult:
    policy: str
    max_mean_ratio: float  # decode ranks (tokens in use)
    max_mean_ratio_prefill: float  # prefill ranks (prompt tokens queued or in progress)
    mean_ttft_s: float
    p50_ttft_s: float
    p99_ttft_s: float
    mean_tpot_s: float


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Picker:
    """One pool's policy over its N x D ranks (flattened), with the scheduler's reservations:
    min_tokens picks the fewest (last reported + reserved since) tokens and reserves the
    prompt on the pick, as `services.scheduler.router.Router` does."""

    def __init__(self, policy: str, cfg: SimConfig, salt: int) -> None:
        self.policy = policy
        self.cfg = cfg
        self.turn = 0
        self.salt = str(salt)
        self.rng = random.Random(cfg.seed * 31 + salt)
        self.reported = [0] * cfg.num_ranks
        self.reservations = Reservations()

    def report(self, used: list[int], now_s: float) -> None:
        self.reported = list(used)
        for w in range(self.cfg.num_workers):
            self.reservations.cover(f"w{w}", now_s - self.cfg.reservation_grace_s)

    def pick(self, req: TraceRequest, now_s: float) -> int:
        n, dp = self.cfg.num_ranks, self.cfg.dp_size
        if self.policy == "round_robin":
            self.turn += 1
            return policies.round_robin(n, self.turn - 1)
        if self.policy == "random":
            return policies.random_pick(n, self.rng)
        if self.policy == "hash":
            return policies.rank_hash(req.request_id + self.salt, n)
        reserved: list[int] = []
        for w in range(self.cfg.num_workers):
            reserved.extend(self.reservations.totals(f"w{w}", dp))
        rank = policies.min_tokens([u + r for u, r in zip(self.reported, reserved, strict=True)])
        self.reservations.add(f"w{rank // dp}", dp, rank % dp, req.prompt_tokens, now_s)
        return rank


@dataclass
class _Seq:
    req: TraceRequest
    decode_rank: int
    prefilled: int = 0
    generated: int = 0
    first_token_s: float = 0.0


@dataclass
class _PrefillRank:
    queue: deque[_Seq] = field(default_factory=deque)
    used_tokens: int = 0  # prompts queued or in progress (their KV is held until pushed)
    busy: bool = False
    chunks: list[tuple[_Seq, int]] = field(default_factory=list)


@dataclass
class _DecodeRank:
    running: list[_Seq] = field(default_factory=list)
    used_tokens: int = 0  # reserved at admission (prompt) + generated
    busy: bool = False


def simulate(policy: str, cfg: SimConfig, trace: list[TraceRequest]) -> SimResult:
    """Disaggregated serving: each request gets a prefill rank and a decode rank at arrival (one
    Schedule call); the decode rank reserves the prompt's KV at once, decoding starts when the
    prefill rank has finished the prompt (first token = TTFT)."""
    prefill = [_PrefillRank() for _ in range(cfg.num_ranks)]
    decode = [_DecodeRank() for _ in range(cfg.num_ranks)]
    pick_prefill = _Picker(policy, cfg, salt=1)
    pick_decode = _Picker(policy, cfg, salt=2)
    ttft: dict[str, float] = {}
    tpot: dict[str, float] = {}
    warmup_s = trace[int(len(trace) * cfg.warmup_fraction)].arrival_s
    end_s = trace[-1].arrival_s
    sums = {"d_max": 0.0, "d_mean": 0.0, "p_max": 0.0, "p_mean": 0.0}
    # Events: (time, order, kind, payload). Kinds: 0 prefill step end, 1 decode step end,
    # 2 arrival, 3 load report, 4 sample.
    events: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, payload: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def start_prefill(ri: int, now: float) -> None:
        rank = prefill[ri]
        budget = cfg.chunk_tokens
        rank.chunks = []
        for sq in rank.queue:
            if budget <= 0:
                break
            take = min(budget, sq.req.prompt_tokens - sq.prefilled)
            rank.chunks.append((sq, take))
            budget -= take
        rank.busy = bool(rank.chunks)
        if rank.busy:
            tokens = cfg.chunk_tokens - budget
            push(now + cfg.prefill_overhead_s + tokens * cfg.prefill_s_per_token, 0, ri)

    def end_prefill(ri: int, now: float) -> None:
        rank = prefill[ri]
        for sq, take in rank.chunks:
            sq.prefilled += take
            if sq.prefilled >= sq.req.prompt_tokens:
                rank.queue.popleft()  # FIFO: a finished prompt is always the head
                rank.used_tokens -= sq.req.prompt_tokens  # KV pushed to the decode rank
                ttft[sq.req.request_id] = now - sq.req.arrival_s
                sq.first_token_s = now
                sq.generated = 1
                d = decode[sq.decode_rank]
                d.used_tokens += 1
                d.running.append(sq)
                if not d.busy:
                    start_decode(sq.decode_rank, now)
        start_prefill(ri, now)

    def start_decode(ri: int, now: float) -> None:
        rank = decode[ri]
        rank.busy = bool(rank.running)
        if rank.busy:
            step_s = cfg.decode_overhead_s + rank.used_tokens * cfg.decode_s_per_kv_token
            push(now + step_s, 1, ri)

    def end_decode(ri: int, now: float) -> None:
        rank = decode[ri]
        still = []
        for sq in rank.running:
            sq.generated += 1
            rank.used_tokens += 1
            if sq.generated >= sq.req.output_tokens:
                rank.used_tokens -= sq.req.prompt_tokens + sq.generated
                tpot[sq.req.request_id] = (now - sq.first_token_s) / max(1, sq.generated - 1)
            else:
                still.append(sq)
        rank.running = still
        start_decode(ri, now)

    for i, r in enumerate(trace):
        push(r.arrival_s, 2, i)
    push(0.0, 3, 0)
    push(warmup_s, 4, 0)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0:
            end_prefill(payload, now)
        elif kind == 1:
            end_decode(payload, now)
        elif kind == 2:
            req = trace[payload]
            pi = pick_prefill.pick(req, now)
            di = pick_decode.pick(req, now)
            decode[di].used_tokens += req.prompt_tokens  # admitted: KV blocks reserved
            prefill[pi].queue.append(_Seq(req, di))
            prefill[pi].used_tokens += req.prompt_tokens
            if not prefill[pi].busy:
                start_prefill(pi, now)
        elif kind == 3:
            pick_prefill.report([r.used_tokens for r in prefill], now)
            pick_decode.report([r.used_tokens for r in decode], now)
            if now < end_s:
                push(now + cfg.report_interval_s, 3, 0)
        elif kind == 4:
            d_loads = [r.used_tokens for r in decode]
            p_loads = [r.used_tokens for r in prefill]
            sums["d_max"] += max(d_loads)
            sums["d_mean"] += sum(d_loads) / len(d_loads)
            sums["p_max"] += max(p_loads)
            sums["p_mean"] += sum(p_loads) / len(p_loads)
            if now < end_s:
                push(now + cfg.sample_interval_s, 4, 0)
    measured = [r.request_id for r in trace if r.arrival_s >= warmup_s]
    ttfts = [ttft[i] for i in measured]
    return SimResult(
        policy=policy,
        max_mean_ratio=sums["d_max"] / sums["d_mean"],
        max_mean_ratio_prefill=sums["p_max"] / max(sums["p_mean"], 1e-9),
        mean_ttft_s=statistics.fmean(ttfts),
        p50_ttft_s=pct(ttfts, 0.5),
        p99_ttft_s=pct(ttfts, 0.99),
        mean_tpot_s=statistics.fmean(tpot[i] for i in measured),
    )


def run_simulation(cfg: SimConfig) -> list[SimResult]:
    trace = make_trace(cfg)
    print(
        f"\n(a) simulation: {cfg.num_workers} prefill + {cfg.num_workers} decode workers x "
        f"{cfg.dp_size} ranks, {cfg.num_requests} requests, Poisson {cfg.arrival_rate_per_s:.1f} "
        f"req/s (prefill pool {cfg.target_prefill_utilization:.0%} busy), prompts "
        f"{cfg.prompt_min_tokens}..{cfg.prompt_max_tokens} tokens, outputs "
        f"{cfg.output_min_tokens}..{cfg.output_max_tokens}, load reports every "
        f"{cfg.report_interval_s} s"
    )
    results = [simulate(p, cfg, trace) for p in SIM_POLICIES]
    base = next(r for r in results if r.policy == "round_robin")
    print(
        f"{'policy':<12} {'max/mean':>9} {'(prefill)':>10} {'mean TTFT':>10} {'p50 TTFT':>9} "
        f"{'p99 TTFT':>9} {'p50 vs rr':>10} {'mean TPOT':>10}"
    )
    for r in results:
        delta = (r.p50_ttft_s / base.p50_ttft_s - 1) * 100
        print(
            f"{r.policy:<12} {r.max_mean_ratio:>9.3f} {r.max_mean_ratio_prefill:>10.3f} "
            f"{r.mean_ttft_s * 1000:>8.0f}ms {r.p50_ttft_s * 1000:>7.0f}ms "
            f"{r.p99_ttft_s * 1000:>7.0f}ms {delta:>+9.1f}% {r.mean_tpot_s * 1000:>8.1f}ms"
        )
    return results


def run_seed_sweep(cfg: SimConfig, seeds: tuple[int, ...]) -> dict[str, float]:
    """The main comparison on other traces (seeds): how much of the gain is the trace."""
    gains, rr_ratios, mt_ratios = [], [], []
    for seed in seeds:
        c = replace(cfg, seed=seed)
        trace = make_trace(c)
        rr, mt = (simulate(p, c, trace) for p in ("round_robin", "min_tokens"))
        gains.append(1 - mt.p50_ttft_s / rr.p50_ttft_s)
        rr_ratios.append(rr.max_mean_ratio)
        mt_ratios.append(mt.max_mean_ratio)
    print(
        f"\nother traces (seeds {list(seeds)}): p50 TTFT min_tokens vs round_robin "
        f"{-max(gains) * 100:+.1f}% .. {-min(gains) * 100:+.1f}% "
        f"(mean {-statistics.fmean(gains) * 100:+.1f}%); "
        f"max/mean rr {min(rr_ratios):.2f}..{max(rr_ratios):.2f}, min_tokens "
        f"{min(mt_ratios):.3f}..{max(mt_ratios):.3f}"
    )
    return {
        "p50_ttft_gain_min": round(min(gains), 4),
        "p50_ttft_gain_max": round(max(gains), 4),
        "p50_ttft_gain_mean": round(statistics.fmean(gains), 4),
        "round_robin_max_mean_min": round(min(rr_ratios), 4),
        "min_tokens_max_mean_max": round(max(mt_ratios), 4),
    }


def run_load_sweep(cfg: SimConfig, utilizations: tuple[float, ...]) -> list[dict[str, float]]:
    """min_tokens vs round_robin at other prefill loads (same trace shape, fewer requests)."""
    print("\nload sweep (min_tokens vs round_robin):")
    print(
        f"{'prefill busy':>12} {'rr max/mean':>12} {'mt max/mean':>12} {'p50 TTFT rr':>12} "
        f"{'p50 TTFT mt':>12} {'mt vs rr':>9}"
    )
    rows = []
    for util in utilizations:
        c = replace(cfg, target_prefill_utilization=util, num_requests=min(cfg.num_requests, 8000))
        trace = make_trace(c)
        rr, mt = (simulate(p, c, trace) for p in ("round_robin", "min_tokens"))
        gain = 1 - mt.p50_ttft_s / rr.p50_ttft_s
        print(
            f"{util:>12.0%} {rr.max_mean_ratio:>12.3f} {mt.max_mean_ratio:>12.3f} "
            f"{rr.p50_ttft_s * 1000:>10.0f}ms {mt.p50_ttft_s * 1000:>10.0f}ms {-gain * 100:>+8.1f}%"
        )
        rows.append(
            {
                "prefill_utilization": util,
                "round_robin_max_mean": round(rr.max_mean_ratio, 4),
                "min_tokens_max_mean": round(mt.max_mean_ratio, 4),
                "p50_ttft_gain": round(gain, 4),
            }
        )
    return rows
