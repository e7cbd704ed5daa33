"""What the engine benchmark runs: its flags (and the defaults derived from the machine), the
contenders, the results file, and the flags a contender's subprocess gets."""

from __future__ import annotations

import argparse
import os

from services.up_shape import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE

# pdserve_eager: the engine with --no-cuda-graphs (CUDA only, where pdserve replays its decode
# steps as CUDA graphs; left out on CPU, where both are the same engine). pdserve_no_row_copy: the
# engine with --no-cpu-row-copy (CPU only: every step on oneDNN, no panel kernel). pdserve_fp8:
# the engine with --quantization fp8 (CUDA only: on a CPU FP8 products are a reference, slower)
CONTENDERS = (
    "hf_sequential",
    "hf_padded",
    "hf_continuous",
    "pdserve",
    "pdserve_transformers",
    "pdserve_eager",
    "pdserve_torch",
    "pdserve_no_row_copy",
    "pdserve_fp8",
)


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        default="default",
        help='"default" (SmolLM2), a folder, or a random-weight shape such as random:llama-8b',
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=448)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the transformers contenders (0 = torch default)",
    )
    parser.add_argument(
        "--engine-dp-size",
        type=int,
        default=0,
        help="pdserve DP ranks, requests alternate ranks (0 = auto: on CPU one "
        "rank per core up to 2, each with 1 thread; on CUDA 1)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=-1,
        help="pdserve torch threads (-1 = auto: 1 with several CPU ranks, else --threads)",
    )
    parser.add_argument("--kv-cache-tokens", type=int, default=10240)
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="per-step token budget of the engine and generate_batch; "
        "0 = the engine's device default (512 on CPU), 2048 for generate_batch",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="KV block size of the pdserve engine (tokens); 0 = as `pdserve up` serves: 16 on CPU, "
        "32 on a GPU",
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--floor-batches", default="1,8,16", help="sequences per decode step in the floor probe (comma list)"
    )
    parser.add_argument("--no-prefix-run", action="store_true")
    parser.add_argument(
        "--no-floor-run",
        action="store_true",
        help="skip the bandwidth probe and decode-step-vs-floor measurement",
    )
    parser.add_argument(
        "--output",
        default="",
        help="default benchmarks/results/engine-<machine class>.json (-quick with --quick; e.g. "
        "engine-cpu-avx512.json, engine-cuda-h200.json)",
    )
    parser.add_argument("--child-timeout-s", type=float, default=900)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt = 4, 16, 64
        args.new_tokens, args.prefix_tokens = 8, 64
    if args.engine_dp_size <= 0:
        cpu_ranks = min(2, os.cpu_count() or 1)
        args.engine_dp_size = cpu_ranks if args.device == "cpu" else 1
    if args.block_size <= 0:
        args.block_size = CPU_BLOCK_SIZE if args.device == "cpu" else GPU_BLOCK_SIZE
    if args.engine_threads < 0:
        args.engine_threads = 1 if args.device == "cpu" and args.engine_dp_size > 1 else args.threads
    return args


def child_argv(args: argparse.Namespace) -> list[str]:
    """The flags a contender's subprocess gets (the parent's workload and engine shape)."""
    return [
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--num-requests",
        str(args.num_requests),
        "--min-prompt",
        str(args.min_prompt),
        "--max-prompt",
        str(args.max_prompt),
        "--new-tokens",
        str(args.new_tokens),
        "--prefix-tokens",
        str(args.prefix_tokens),
        "--threads",
        str(args.threads),
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--engine-dp-size",
        str(args.engine_dp_size),
        "--engine-threads",
        str(args.engine_threads),
        "--floor-batches",
        args.floor_batches,
        "--block-size",
        str(args.block_size),
    ]
