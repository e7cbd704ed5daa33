"""Running the speculative decoding benchmark: one case (a group of requests at a concurrency) on
an engine, with its tokens/s, latency, acceptance and outputs; repetitions combined; every case
of a run (`run_all`); the machine it ran on."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from typing import Any


def machine() -> dict[str, Any]:
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "load_average_1_5_15": load,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # the load at the start; each case's line also prints the load while it ran
        "note": (
            "quiet machine (1-minute load average below 1.5)"
            if load and load[0] < 1.5
            else "shared, loaded machine (other jobs use the same cores): noisy timings"
        ),
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def prompts_of(tokenizer: Any, texts: list[str]) -> list[tuple[int, ...]]:
    out = []
    for text in texts:
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(tuple(int(t) for t in tokenizer.encode(chat, add_special_tokens=False)))
    return out


async def _one(
    engine: Any, rid: str, prompt: tuple[int, ...], max_tokens: int
) -> tuple[list[float], list[int]]:
    from services.worker.engine.api import EngineRequest, SamplingConfig

    sp = SamplingConfig(max_tokens=max_tokens, temperature=0.0)
    times: list[float] = []
    tokens: list[int] = []
    async for out in engine.add_request(EngineRequest(rid, prompt, sp)):
        now = time.perf_counter()
        times.extend([now] * len(out.new_token_ids))
        tokens.extend(out.new_token_ids)
    return times, tokens


async def run_case(
    engine: Any, tag: str, prompts: list[tuple[int, ...]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    before = engine.spec_stats(0)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    results: list[tuple[list[float], list[int]]] = []
    starts: list[float] = []
    for i in range(0, len(prompts), concurrency):
        group = prompts[i : i + concurrency]
        start = time.perf_counter()
        starts += [start] * len(group)
        results += await asyncio.gather(
            *(_one(engine, f"{tag}-{i + j}", p, max_tokens) for j, p in enumerate(group))
        )
    wall = time.perf_counter() - t0
    # CPU time of the whole process (the engine's step thread does nearly all of it): steadier
    # than wall time on a shared machine, where other jobs take the cores
    cpu = time.process_time() - cpu0
    after = engine.spec_stats(0)
    n_tokens = sum(len(toks) for _, toks in results)
    tpot = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t, _ in results if len(t) > 1]
    ttft = [(t[0] - s) * 1e3 for (t, _), s in zip(results, starts, strict=True) if t]
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [
        a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
        for i, a in enumerate(after.accepted_per_position)
    ]
    decode_s = sum(t[-1] - t[0] for t, _ in results if len(t) > 1)
    decode_tokens = sum(len(t) - 1 for t, _ in results if len(t) > 1)
    return {
        "requests": len(prompts),
        "tokens": n_tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(n_tokens / wall, 2),
        "cpu_s": round(cpu, 3),
        "tokens_per_cpu_s": round(n_tokens / cpu, 2) if cpu > 0 else None,
        # after each request's first token (prefill excluded), summed over requests
        "decode_tokens_per_s_per_request": round(decode_tokens / decode_s, 2) if decode_s else None,
        "tpot_ms_p50": _r(percentile(tpot, 50)),
        "tpot_ms_p90": _r(percentile(tpot, 90)),
        "ttft_ms_p50": _r(percentile(ttft, 50)),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "drafts": after.num_drafts - before.num_drafts,
        "accepted_per_position": per_pos,
        # the rank's learned step cost after the case (ms: fixed, per sequence, per proposal)
        "step_cost_ms": [round(x, 3) for x in after.step_cost_ms] if after.step_cost_ms else None,
        "output_tokens": [toks for _, toks in results],
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repetitions of one case as one: totals summed, rates recomputed from the totals, latency
    percentiles the median of the repetitions', the outputs of the first."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in ("tokens", "wall_s", "cpu_s", "draft_tokens", "accepted_tokens", "drafts"):
        out[key] = round(sum(r[key] for r in runs), 3)
    out["requests"] = sum(r["requests"] for r in runs)
    out["tokens_per_s"] = round(out["tokens"] / out["wall_s"], 2)
    out["tokens_per_cpu_s"] = round(out["tokens"] / out["cpu_s"], 2) if out["cpu_s"] else None
    out["tokens_per_s_each"] = [r["tokens_per_s"] for r in runs]
    for key in ("decode_tokens_per_s_per_request", "tpot_ms_p50", "tpot_ms_p90", "ttft_ms_p50"):
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = percentile(vals, 50)
    drafted = out["draft_tokens"]
    out["acceptance_rate"] = round(out["accepted_tokens"] / drafted, 3) if drafted else None
    positions = max(len(r["accepted_per_position"]) for r in runs)
    out["accepted_per_position"] = [
        sum(r["accepted_per_position"][i] for r in runs if i < len(r["accepted_per_position"]))
        for i in range(positions)
    ]
    out["step_cost_ms"] = runs[-1]["step_cost_ms"]
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


async def run_all(
    args: argparse.Namespace,
    engines: dict[str, Any],
    workloads: dict[str, list[tuple[int, ...]]],
    modes: tuple[str, ...],
) -> dict[str, Any]:
    """Every case of a run: (workload, concurrency) x mode, repeated and combined, printed as it
    ends; outputs checked against speculation off."""
    for mode, engine in engines.items():  # first-step costs out of the measurement
        await run_case(engine, f"warm-{mode}", [workloads["open"][0]], 1, 4)
    results: dict[str, Any] = {}
    for wname, prompts in workloads.items():
        results[wname] = {}
        for conc in (1, args.concurrency):
            group = prompts[: args.requests_c1] if conc == 1 else prompts[:conc]
            key = f"c{conc}" if not args.quick else ("c1" if conc == 1 else "c8")
            reps: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for rep in range(args.repeat):
                # interleaved per case, alternating which goes first: same machine state
                order = modes if rep % 2 == 0 else tuple(reversed(modes))
                for mode in order:
                    reps[mode].append(
                        await run_case(
                            engines[mode], f"{wname}-{conc}-{mode}-{rep}", group, conc, args.max_tokens
                        )
                    )
            case: dict[str, Any] = {mode: combine(runs) for mode, runs in reps.items()}
            off_tokens = case["off"].pop("output_tokens")
            case["identical_outputs"] = off_tokens == case["ngram"].pop("output_tokens")
            if "draft" in case:
                draft = case["draft"]
                draft["identical_outputs"] = off_tokens == draft.pop("output_tokens")
                draft["speedup"] = round(draft["tokens_per_s"] / case["off"]["tokens_per_s"], 2)
            case["speedup"] = round(case["ngram"]["tokens_per_s"] / case["off"]["tokens_per_s"], 2)
            off_c = case["off"]["tokens_per_cpu_s"]
            on_c = case["ngram"]["tokens_per_cpu_s"]
            case["speedup_cpu"] = round(on_c / off_c, 2) if off_c and on_c else None
            off_d = case["off"]["decode_tokens_per_s_per_request"]
            on_d = case["ngram"]["decode_tokens_per_s_per_request"]
            case["decode_speedup"] = round(on_d / off_d, 2) if off_d and on_d else None
            results[wname][key] = case
            off, on = case["off"], case["ngram"]
            print(
                f"{wname:>9} {key}: off {off['tokens_per_s']:7.1f} tok/s (TPOT p50 "
                f"{off['tpot_ms_p50']} p90 {off['tpot_ms_p90']} ms) | ngram "
                f"{on['tokens_per_s']:7.1f} tok/s (TPOT p50 {on['tpot_ms_p50']} p90 "
                f"{on['tpot_ms_p90']} ms, acceptance {on['acceptance_rate']}) | "
                f"{case['speedup']:.2f}x (decode only {case['decode_speedup']}x, per CPU second "
                f"{case['speedup_cpu']}x), identical: {case['identical_outputs']}, step cost "
                f"{on['step_cost_ms']} ms, load {[round(x, 1) for x in os.getloadavg()]}"
            )
            if "draft" in case:
                d = case["draft"]
                print(
                    f"{'':>9} {key}: draft {d['tokens_per_s']:7.1f} tok/s (acceptance "
                    f"{d['acceptance_rate']}) | {d['speedup']:.2f}x vs off, identical: "
                    f"{d['identical_outputs']}"
                )
    return results
