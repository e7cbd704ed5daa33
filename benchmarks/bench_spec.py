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
rate (accepted / proposed tokens) and the ratios ngram / off. Writes
benchmarks/results/spec-<machine class>.json (spec-cpu-avx512.json; `speedup` = {"grounded":
{"c1", "c8"}, "open": {"c1", "c8"}}, tokens/s ngram / off) and the .png beside it, and records
the machine (CPU capability, cores, torch version, load average): numbers taken on a shared,
loaded machine are noisy. `speedup_cpu` is the same ratio per CPU second of the process
(steadier there); `--repeat N` runs each case N times, off and ngram alternating, and reports the
totals; ends with each ratio against its target (issue 13).
This module is the command; the parts are in `benchmarks/spec/` (config, run, report).
"""

from __future__ import annotations

import asyncio

from benchmarks.spec import report
from benchmarks.spec.config import GROUNDED, OPEN, parse_args
from benchmarks.spec.run import machine, prompts_of, run_all


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])
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

    try:
        results = asyncio.run(run_all(args, engines, workloads, modes))
    finally:
        for engine in engines.values():
            engine.shutdown()
    report.write(args, results, path, dtype)


if __name__ == "__main__":
    main()
