"""Speculative decoding benchmark (`make bench-spec`): the pdserve engine in process with
speculation off vs `ngram` (prompt lookup), on the default model (CPU fp32; `--device cuda`:
bf16 with CUDA graphs), in one run.

Workloads (chat template applied, greedy, so both modes produce the same tokens; checked):
- grounded: the answer is largely in the prompt (rewrite or extract from a given passage, edit
  given code), where n-gram lookup finds long runs;
- open: open-ended questions, where it finds little (speculation should cost nothing there).
Each at concurrency 1 (requests one after another) and 8 (8 requests arriving together).

Reported per (workload, concurrency, mode): aggregate tokens/s (generated tokens / wall time,
prefill included; `speedup` is its ratio), decode tokens/s (after each first token),
TPOT p50/p90 (per request: (last token - first token) / (tokens - 1)), TTFT p50, the acceptance
rate (accepted / proposed tokens) and the ratios ngram / off. Writes benchmarks/results/spec.json
(`speedup` = {"grounded": {"c1", "c8"}, "open": {"c1", "c8"}}, tokens/s ngram / off) and
benchmarks/results/spec.png, and records the machine (CPU capability, cores, torch version, load
average): numbers taken on a shared, loaded machine are noisy. `speedup_cpu` is the same ratio per
CPU second of the process (steadier there); `--repeat N` runs each case N times, off and ngram
alternating, and reports the totals; ends with each ratio against its target (issue 13).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "spec.json"

PASSAGE = (
    "The Meridian Bridge opened in 1932 after six years of construction. It spans 1,240 metres "
    "across the Alder River and carries four lanes of traffic and two railway tracks. Its chief "
    "engineer, Clara Voss, insisted on a suspension design because the riverbed could not hold "
    "the piers a cantilever bridge would need. During the flood of 1954 the bridge was closed "
    "for eleven days while divers inspected the anchorages. A pedestrian walkway was added in "
    "1987, and in 2011 the original steel cables were replaced with galvanized ones. Today about "
    "62,000 vehicles cross the bridge every day, and the city plans to add a protected bicycle "
    "lane by 2027."
)

CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    total = total + total * tax_rate
    return round(total, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""

GROUNDED = [
    f"Rewrite the following passage in the past perfect tense where possible, keeping every "
    f"fact:\n\n{PASSAGE}",
    f"Copy the following passage exactly, but replace the name Clara Voss with Maria Lind:\n\n{PASSAGE}",
    f"Extract every sentence of the passage that contains a year, one per line, word for word:\n\n{PASSAGE}",
    f"Rename the function total_price to compute_total and the variable items to cart in this "
    f"code. Output the whole code.\n\n{CODE}",
    f"Add a docstring to each function in this code and output the whole code:\n\n{CODE}",
    f"Repeat the passage below, then add one sentence summarizing it.\n\n{PASSAGE}",
    f"Rewrite this code so that total uses += instead of total = total + ...; output all of it.\n\n{CODE}",
    f"Correct any mistakes and output the corrected passage in full:\n\n"
    f"{PASSAGE.replace('construction', 'constructoin').replace('traffic', 'trafic')}",
]

OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying healthy? Explain each.",
    "Describe a day in the life of a honeybee.",
    "Give me some ideas for a birthday party for my grandmother.",
    "Why do people enjoy music? Write a few paragraphs.",
    "Write a poem about the autumn wind.",
    "What would you pack for a week-long hiking trip, and why?",
]


# issue 13: ngram / off tokens/s at least this much
TARGETS = {"grounded": {"c1": 2.0, "c8": 1.3}, "open": {"c1": 0.95, "c8": 0.95}}


def target_lines(report: dict[str, Any]) -> list[str]:
    """One line per case: the wall-clock ratio (and per CPU second) against its target."""
    lines = []
    for w, cases in TARGETS.items():
        for c, target in cases.items():
            got = report["speedup"].get(w, {}).get(c)
            cpu = report["speedup_cpu"].get(w, {}).get(c)
            verdict = "n/a" if got is None else ("ok" if got >= target else "BELOW")
            lines.append(f"  {w:>8} {c}: {got}x (per CPU second {cpu}x) vs target >= {target}x: {verdict}")
    return lines


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


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(w, c) for w in ("grounded", "open") for c in ("c1", "c8")]
    labels = [f"{w}\n{c}" for w, c in cases]
    off = [report["results"][w][c]["off"]["tokens_per_s"] for w, c in cases]
    ngram = [report["results"][w][c]["ngram"]["tokens_per_s"] for w, c in cases]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], off, 0.4, label="speculation off")
    ax.bar([i + 0.2 for i in x], ngram, 0.4, label="ngram")
    for i, (a, b) in enumerate(zip(off, ngram, strict=True)):
        ax.text(i + 0.2, b, f"{b / a:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("generated tokens/s")
    m = report["machine"]
    ax.set_title(
        f"pdserve speculative decoding, {report['config']['model_id']} "
        f"{report['config']['device']} {report['config']['dtype']}\n"
        f"{m.get('cuda_device') or m['cpu_capability']}, {m['cpu_count']} cores ({m['note']})",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (CUDA: decode graphs on)")
    parser.add_argument("--dtype", default="", help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--requests-c1", type=int, default=4, help="requests per workload at concurrency 1")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per engine; 0 = torch default (on a shared, "
        "oversubscribed machine one thread is far steadier)",
    )
    parser.add_argument(
        "--no-step-cost",
        action="store_true",
        help="ngram without the step-cost model: every proposal verified up to the per-step cap "
        "(the behaviour before the cost model, for comparison)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each case this many times, off and ngram alternating, and report the totals "
        "(steadier ratios on a shared machine)",
    )
    parser.add_argument(
        "--draft-model",
        default="",
        help="also measure `draft` speculation with this draft model (same tokenizer). Not run by "
        "default: SmolLM2-135M is the smallest model available offline, so no smaller draft exists",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few short requests")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.requests_c1, args.concurrency = 24, 1, 2

    from transformers import AutoTokenizer

    from services.worker.engine import create_engine
    from services.worker.engine.api import EngineConfig
    from shared.model_store import resolve_model

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    workloads = {"grounded": prompts_of(tokenizer, GROUNDED), "open": prompts_of(tokenizer, OPEN)}
    engines = {}
    modes = ("off", "ngram", "draft") if args.draft_model else ("off", "ngram")
    draft_path = str(resolve_model(args.draft_model)) if args.draft_model else ""
    for mode in modes:
        cfg = EngineConfig(
            model_path=path,
            device=args.device,
            dtype=dtype,
            torch_threads=args.threads,
            speculative=mode,
            num_speculative_tokens=args.num_speculative_tokens,
            kv_cache_tokens=16384,
            spec_step_cost=not args.no_step_cost,
            draft_model_path=draft_path if mode == "draft" else "",
        )
        engines[mode] = create_engine(cfg)
        engines[mode].start()
    print(
        f"model {path}, {args.device} {dtype}, k={args.num_speculative_tokens}, max_tokens "
        f"{args.max_tokens}; machine: {machine()}"
    )

    async def go() -> dict[str, Any]:
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

    try:
        results = asyncio.run(go())
    finally:
        for engine in engines.values():
            engine.shutdown()
    identical_expected = dtype == "float32" and args.device == "cpu"
    report = {
        "speedup": {w: {c: results[w][c]["speedup"] for c in results[w]} for w in results},
        "speedup_cpu": {w: {c: results[w][c]["speedup_cpu"] for c in results[w]} for w in results},
        "targets": TARGETS,
        "draft": (
            {w: {c: results[w][c]["draft"]["speedup"] for c in results[w]} for w in results}
            if args.draft_model
            else "not measured: SmolLM2-135M is the smallest model available offline, so there is "
            "no meaningful smaller draft (run with --draft-model to measure one)"
        ),
        "results": results,
        "config": {
            "model": args.model,
            "model_id": Path(path).name,
            "device": args.device,
            "dtype": dtype,
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.num_speculative_tokens,
            "spec_step_cost": not args.no_step_cost,
            "draft_model": args.draft_model,
            "requests_c1": args.requests_c1,
            "concurrency": args.concurrency,
            "quick": args.quick,
            "repeat": args.repeat,
            "sampling": "greedy",
            "command": "make bench-spec",
            # greedy output with speculation equals output without only where a verify step's
            # logits are bit-equal to a plain step's: fp32 on the CPU. In bf16 (CUDA) a verify
            # step runs other kernel shapes, whose rounding can flip near-ties
            "identical_expected": identical_expected,
        },
        "machine": machine(),
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(report, png)
    if not identical_expected:
        print(
            f"({dtype} on {args.device}: outputs may differ with speculation; identity holds in fp32 on CPU)"
        )
    print(f"speedup (ngram / off tokens/s): {report['speedup']}")
    for line in target_lines(report):
        print(line)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
