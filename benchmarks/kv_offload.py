"""The prefix cache's host tier (`--kv-offload-tokens`): the time to first token of a prompt that
comes back after other prompts evicted its blocks from the KV pool, served three ways in one run:

  pool      its blocks are still in the pool (a plain prefix hit: the floor)
  host      the pool evicted them; the host tier copies them back (kv_offload.py)
  recompute the pool evicted them and there is no tier: the prompt is prefilled again

For each way, the revisited prompt's first token is timed from adding the request (one request
at a time, greedy); `host / recompute` is what the tier saves. The pool holds one prompt and a
bit: `--evictors` other prompts of the same length run between the first and the second visit.
On a GPU (`--device cuda --model random:llama-8b`, built on the device) a copy back from pinned
host memory replaces a prefill; on a CPU the pool is host memory already, so the tier's copy is
a memcpy against a prefill's compute.

    python -m benchmarks.kv_offload [--model random:smollm2] [--prompt-tokens 1024] [--repeats 3]

Writes benchmarks/results/kv-offload-<machine class>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.result_names import describe_machine, result_path


async def _first_token_s(engine: Any, request: Any) -> tuple[float, int]:
    """Seconds from adding `request` to its first token, and its cached prompt tokens (the rest
    of the request is drained)."""
    t0 = time.perf_counter()
    handle = engine.add_request(request)
    first: float | None = None
    cached = 0
    async for out in handle:
        if first is None and out.new_token_ids:
            first = time.perf_counter() - t0
        cached = out.num_local_cached_tokens
    assert first is not None
    return first, cached


def run_way(args: argparse.Namespace, way: str) -> dict[str, Any]:
    from services.worker.engine import create_engine
    from services.worker.engine.api import EngineConfig, EngineRequest, SamplingConfig
    from shared.model_store import resolve_model

    n = args.prompt_tokens
    block = args.block_size
    engine = create_engine(
        EngineConfig(
            model_path=str(resolve_model(args.model)),
            device=args.device,
            dtype=args.dtype,
            block_size=block,
            # one prompt (and its output) and a bit: the next prompt evicts the one before
            kv_cache_tokens=n + 8 * block,
            kv_offload_tokens=(args.evictors + 2) * (n + block) if way == "host" else 0,
            max_num_seqs=4,
            torch_threads=args.threads,
        )
    )
    engine.start()
    rng = random.Random(7)
    vocab = min(int(getattr(engine, "vocab_size", 0)) or 49152, 40000)
    sampling = SamplingConfig(max_tokens=2, temperature=0.0, ignore_eos=True)

    def prompt() -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    times: list[float] = []
    cold: list[float] = []
    cached = 0

    async def visits() -> None:  # one event loop: the engine's outputs are bound to it
        nonlocal cached
        for r in range(args.repeats):
            revisit = prompt()
            t_cold, _ = await _first_token_s(engine, EngineRequest(f"a{r}", revisit, sampling))
            cold.append(t_cold)
            if way != "pool":
                for k in range(args.evictors):
                    await _first_token_s(engine, EngineRequest(f"e{r}-{k}", prompt(), sampling))
            t, cached = await _first_token_s(engine, EngineRequest(f"b{r}", revisit, sampling))
            times.append(t)

    try:
        asyncio.run(visits())
        stats = engine.kv_offload_stats(0)
    finally:
        engine.shutdown()
    return {
        "way": way,
        "ttft_ms": round(statistics.median(times) * 1e3, 2),
        "ttft_ms_runs": [round(t * 1e3, 2) for t in times],
        "cold_ttft_ms": round(statistics.median(cold) * 1e3, 2),
        "cached_tokens": cached,
        "offload_stats": stats,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2", help="random:<shape>, default or a folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--evictors", type=int, default=2, help="prompts run between the two visits")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="", help="default benchmarks/results/kv-offload-<class>.json")
    args = parser.parse_args(argv)
    rows = {way: run_way(args, way) for way in ("pool", "host", "recompute")}
    for row in rows.values():
        print(
            f"{row['way']:9s} TTFT {row['ttft_ms']:8.2f} ms (cold {row['cold_ttft_ms']:.2f}), "
            f"{row['cached_tokens']} tokens cached, tier {row['offload_stats']}"
        )
    host, recompute, pool = (rows[w]["ttft_ms"] for w in ("host", "recompute", "pool"))
    ratios = {
        "host_over_recompute": round(host / recompute, 3),
        "host_over_pool_hit": round(host / pool, 3),
    }
    print(
        f"host / recompute {ratios['host_over_recompute']}x, host / pool hit {ratios['host_over_pool_hit']}x"
    )
    machine = describe_machine(args.device)
    doc = {
        "command": "python -m benchmarks.kv_offload " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "model": args.model,
        "workload": {
            k: getattr(args, k) for k in ("prompt_tokens", "block_size", "evictors", "repeats", "dtype")
        },
        "results": list(rows.values()),
        "ratios": ratios,
    }
    out = Path(args.out) if args.out else result_path("kv-offload", args.device)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
