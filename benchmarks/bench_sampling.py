"""Sampling-feature overhead (`make bench-sampling`): the decode step of 8 sequences with plain
sampling vs logprobs (top 5) vs penalties + logit_bias vs both vs half of them constrained by a
JSON schema (structured outputs), on one engine in one run.

Workload: 8 concurrent requests, 128-token prompts (random ids, fixed seed), 48 new tokens each
(EOS ignored), seeded sampling at temperature 0.8; on the penalty variants presence 0.5,
frequency 0.3, repetition 1.1 and a 4-entry logit_bias; the variants run in interleaved rounds
(A B C D A B C D ...) on the same engine so machine noise hits each alike. Reported per variant:
the median over rounds of the decode step time (the request's mean gap between its later tokens,
median over the 8 requests) and its ratio to plain; the process CPU time per step (steadier than
wall time when other processes share the cores) and its ratio; and the sampler alone on [8, vocab] logits
(median of 200 calls, --sampler-calls). The issue's targets: logprobs <= 1.05x the plain step,
half JSON schema <= 1.1x.

Prompt logprobs (completions echo scoring): one request's prefill of --prefill-tokens (512)
tokens alone on the engine, plain (the first token sampled) vs with prompt_logprobs 5 (the LM
head, log_softmax and top-5 at every prompt position, then the first token) vs prompt_logprobs
5 with max_tokens 0 (scoring only), interleaved rounds (--prefill-rounds), median wall and
CPU time per prefill and their ratios to plain. --skip-decode runs only this part.

Writes benchmarks/results/sampling-<machine class>.json (sampling-cpu-avx512.json).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.result_names import result_path
from services.worker.engine import create_engine
from services.worker.engine.api import EngineConfig, EngineRequest, SamplingConfig
from services.worker.engine.sampler import TokenHistory, sample, sample_with_logprobs
from shared.structured_output import StructuredOutput

PENALTIES: dict[str, Any] = dict(
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    logit_bias=((10, 2.0), (20, -2.0), (30, 1.0), (40, -100.0)),
)
# an unbounded schema, so a constrained request decodes as long as the others
SCHEMA = StructuredOutput("json_schema", json.dumps({"type": "array", "items": {"type": "string"}}))
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": PENALTIES,
    "both": {**PENALTIES, "logprobs": 5},
    "json_schema_half": {"structured": SCHEMA},  # on every other request only
}


async def _round(
    engine: Any, prompts: list[tuple[int, ...]], sampling: SamplingConfig, tag: str, half: bool = False
) -> tuple[float, float]:
    """Median over the requests of the mean gap between their later tokens (s), and the
    process's CPU time per step (s; prefill included, the same in every variant), which other
    processes on the machine disturb far less than wall time. `half`: only every other request
    keeps `sampling.structured`."""
    times: list[list[float]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        sp = dataclasses.replace(sampling, structured=None) if half and i % 2 else sampling
        handle = engine.add_request(EngineRequest(f"{tag}-{i}", prompts[i], sp))
        async for out in handle:
            times[i].extend([time.perf_counter()] * len(out.new_token_ids))

    cpu0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    cpu_s = time.process_time() - cpu0
    gaps = [(t[-1] - t[1]) / (len(t) - 2) for t in times if len(t) > 2]
    return statistics.median(gaps), cpu_s / max(len(t) for t in times)


async def _prefill(
    engine: Any, prompt: tuple[int, ...], sampling: SamplingConfig, tag: str
) -> tuple[float, float]:
    """One request alone: (wall s, process CPU s) from add_request to its last output."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    async for _ in engine.add_request(EngineRequest(tag, prompt, sampling)):
        pass
    return time.perf_counter() - t0, time.process_time() - cpu0


PREFILL_VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"max_tokens": 1},
    "prompt_logprobs_5": {"max_tokens": 1, "prompt_logprobs": 5},
    "prompt_logprobs_5_max_tokens_0": {"max_tokens": 0, "prompt_logprobs": 5},
}


async def _prefill_rounds(engine: Any, prompt: tuple[int, ...], rounds: int) -> dict[str, Any]:
    wall: dict[str, list[float]] = {name: [] for name in PREFILL_VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in PREFILL_VARIANTS}
    await _prefill(engine, prompt, SamplingConfig(max_tokens=1, prompt_logprobs=5), "prefill-warm")
    for r in range(rounds):
        for name, extra in PREFILL_VARIANTS.items():
            w, c = await _prefill(engine, prompt, SamplingConfig(temperature=0.0, **extra), f"{name}-{r}")
            wall[name].append(w)
            cpu[name].append(c)
    wall_ms = {name: round(statistics.median(v) * 1e3, 1) for name, v in wall.items()}
    cpu_ms = {name: round(statistics.median(v) * 1e3, 1) for name, v in cpu.items()}
    return {
        "prompt_tokens": len(prompt),
        "rounds": rounds,
        "wall_ms": wall_ms,
        "wall_ratio_vs_plain": {name: round(v / wall_ms["plain"], 3) for name, v in wall_ms.items()},
        "cpu_ms": cpu_ms,
        "cpu_ratio_vs_plain": {name: round(v / cpu_ms["plain"], 3) for name, v in cpu_ms.items()},
        "rounds_wall_ms": {name: [round(x * 1e3, 1) for x in v] for name, v in wall.items()},
    }


def _sampler_alone(vocab: int, n: int, calls: int) -> dict[str, float]:
    torch.manual_seed(0)
    logits = torch.randn(n, vocab)
    history = TokenHistory(tuple(random.Random(1).randrange(vocab) for _ in range(176)), 48)
    out: dict[str, float] = {}
    for name, extra in VARIANTS.items():
        if "structured" in extra:
            continue  # the masks come from the rank, not the sampler (engine/structured.py)
        params = [SamplingConfig(max_tokens=48, temperature=0.8, seed=i, **extra) for i in range(n)]
        gens = [torch.Generator() for _ in range(n)]
        seeds = list(range(n))
        hists = [history] * n
        fn = sample_with_logprobs if "logprobs" in extra else sample
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn(logits, params, gens, seeds, hists)
            samples.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(samples) * 1e3, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help='"default" (SmolLM2) or a folder')
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sampler-calls", type=int, default=200)
    parser.add_argument("--prefill-tokens", type=int, default=512, help="prompt logprobs part (tokens)")
    parser.add_argument("--prefill-rounds", type=int, default=3)
    parser.add_argument("--skip-decode", action="store_true", help="only the prompt logprobs part")
    parser.add_argument("--out", default="", help="default benchmarks/results/sampling-<machine class>.json")
    args = parser.parse_args(argv)
    if args.model == "default":
        from shared.model_store import resolve_model

        args.model = str(resolve_model("default"))
    engine = create_engine(
        EngineConfig(
            model_path=args.model,
            kv_cache_tokens=8192,
            # the prefills of the prompt-logprobs part in one chunk (0: the device's default, 512
            # on CPU)
            max_batch_tokens=args.prefill_tokens if args.prefill_tokens > 512 else 0,
            torch_threads=args.threads,
            enable_prefix_caching=False,
        )
    )
    engine.start()
    vocab = int(getattr(engine, "vocab_size", 0)) or 49152
    rng = random.Random(0)
    top_id = min(vocab, 40000)
    prompts = [
        tuple(rng.randrange(3, top_id) for _ in range(args.prompt_tokens)) for _ in range(args.num_requests)
    ]
    steps: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpus: dict[str, list[float]] = {name: [] for name in VARIANTS}
    long_prompt = tuple(rng.randrange(3, top_id) for _ in range(args.prefill_tokens))
    prefill: dict[str, Any] = {}

    async def go() -> None:
        prefill.update(await _prefill_rounds(engine, long_prompt, args.prefill_rounds))
        if args.skip_decode:
            return
        await _round(engine, [p[:16] for p in prompts[:2]], SamplingConfig(max_tokens=4), "warm")
        for r in range(args.rounds):
            for name, extra in VARIANTS.items():
                sampling = SamplingConfig(
                    max_tokens=args.new_tokens, temperature=0.8, seed=r, ignore_eos=True, **extra
                )
                half = name.endswith("_half")
                step_s, cpu_s = await _round(engine, prompts, sampling, f"{name}{r}", half)
                steps[name].append(step_s)
                cpus[name].append(cpu_s)

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    if args.skip_decode:
        print(
            json.dumps(
                {"cpu": torch.backends.cpu.get_cpu_capability(), "prompt_logprobs_prefill": prefill}, indent=2
            )
        )
        return
    step_ms = {name: round(statistics.median(v) * 1e3, 2) for name, v in steps.items()}
    cpu_ms = {name: round(statistics.median(v) * 1e3, 2) for name, v in cpus.items()}
    result = {
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": args.threads,
        "workload": {k: getattr(args, k) for k in ("num_requests", "prompt_tokens", "new_tokens", "rounds")},
        "decode_step_ms": step_ms,
        "ratio_vs_plain": {name: round(v / step_ms["plain"], 3) for name, v in step_ms.items()},
        "rounds_ms": {name: [round(x * 1e3, 2) for x in v] for name, v in steps.items()},
        "cpu_ms_per_step": cpu_ms,
        "cpu_ratio_vs_plain": {name: round(v / cpu_ms["plain"], 3) for name, v in cpu_ms.items()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "sampler_alone_ms": _sampler_alone(vocab, args.num_requests, args.sampler_calls),
        "prompt_logprobs_prefill": prefill,
    }
    print(json.dumps(result, indent=2))
    (Path(args.out) if args.out else result_path("sampling")).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
