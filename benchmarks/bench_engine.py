"""Engine benchmark (`make bench-engine`): the pdserve engine in process against transformers'
`generate` (one request at a time, and one padded batch) and transformers' continuous batching
(`generate_batch`), on the same machine, model and dtype, in one run.

Workload: N concurrent requests (default 16) arriving together, prompts spread evenly over
[64, 512] tokens (random token ids, fixed seed), exactly 64 new tokens each (EOS ignored).
Every contender gets the whole machine: transformers with torch's default threads, pdserve (by
default on CPU) as one DP rank per core, up to 2, with one torch thread each (one thread per
rank beats two threads in one on this 2-core CPU, see docs/architecture.md); `--threads 1
--engine-dp-size 1` compares on one core instead. Each contender runs in its own subprocess so
peak RSS is its own. `pdserve_transformers` is the same engine with transformers' own forward
(`--no-lean-forward`), to show what the lean forward (engine/lean_llama.py) gains. Reported per
contender:
aggregate generated tokens/s (all tokens / wall time from the common arrival), TTFT (arrival to
first token) and TPOT (mean gap between a request's later tokens) p50/p99, peak RSS.

Then a prefix-heavy run on the engine: N requests sharing a 448-token prefix (+ 64 own tokens),
one token each, after one warm-up request; prefill wall time with vs without the prefix cache.

Then the floor probe (benchmarks/engine_floor.py): memory read bandwidth (one core, all cores),
the CPU capability torch reports, and one rank's pure decode step for 1, 8 and 16 sequences next
to its floor (weights + KV bytes read per step / single-core bandwidth).

Writes benchmarks/results/engine.json: tokens_per_s (per contender), ratio_vs_hf_sequential,
ratio_vs_hf_padded, ratio_vs_hf_continuous, ratio_lean_vs_transformers_forward (null when that
contender did not run), cpu (what
torch reports), decode_step_vs_floor (8 sequences per rank), floor (the probe), details.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"
# pdserve_eager: the engine with --no-cuda-graphs (CUDA only, where pdserve replays its decode
# steps as CUDA graphs; left out on CPU, where both are the same engine). pdserve_no_row_copy: the
# engine with --no-cpu-row-copy (CPU only: every step on oneDNN, no panel kernel)
CONTENDERS = (
    "hf_sequential",
    "hf_padded",
    "hf_continuous",
    "pdserve",
    "pdserve_transformers",
    "pdserve_eager",
    "pdserve_torch",
    "pdserve_no_row_copy",
)


# ---- workload ------------------------------------------------------------------------------
def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab - 100) for _ in range(k)] for k in lengths]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarize(t0: float, token_times: list[list[float]], wall_s: float) -> dict[str, Any]:
    """token_times[i]: arrival time (perf_counter s) of each generated token of request i."""
    n_tokens = sum(len(t) for t in token_times)
    ttft = [(t[0] - t0) * 1e3 for t in token_times if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in token_times if len(t) > 1]
    return {
        "tokens": n_tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(n_tokens / wall_s, 2),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
    }


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---- contenders (each runs in a fresh subprocess) ------------------------------------------
def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _load_hf(path: str, dtype: str, device: str) -> Any:
    from shared.model_store import load_causal_lm

    # a folder's weights, or the same seeded random weights as the engine (`random:` models)
    return load_causal_lm(path, device, dtype=_torch_dtype(dtype)).eval()


def _gen_config(model: Any, new_tokens: int) -> Any:
    from transformers import GenerationConfig

    # an id outside the vocabulary as EOS: every request generates exactly new_tokens
    return GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=model.config.vocab_size + 1,
        pad_token_id=model.config.pad_token_id or 0,
    )


class _TimingStreamer:
    """A generate() streamer recording when each step's tokens come out (first put = prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_sequential(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    import torch

    model = _load_hf(args.model_path, args.dtype, args.device)
    cfg = _gen_config(model, args.new_tokens)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]], device=args.device), generation_config=cfg)
    times: list[list[float]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            streamer = _TimingStreamer()
            ids = torch.tensor([p], device=args.device)
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, streamer=streamer)
            times.append(streamer.times)
    return summarize(t0, times, time.perf_counter() - t0)


def run_hf_padded(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    import torch

    model = _load_hf(args.model_path, args.dtype, args.device)
    cfg = _gen_config(model, args.new_tokens)
    pad = cfg.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.inference_mode():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], generation_config=cfg)
    streamer = _TimingStreamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, generation_config=cfg, streamer=streamer)
    wall = time.perf_counter() - t0
    return summarize(t0, [list(streamer.times) for _ in prompts], wall)


def run_hf_continuous(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig

    model = _load_hf(args.model_path, args.dtype, args.device)
    cfg = _gen_config(model, args.new_tokens)
    # a small explicit KV budget: by default it reserves most of free RAM on CPU
    need_tokens = sum(len(p) + args.new_tokens for p in prompts)
    cb = ContinuousBatchingConfig(
        page_size=256,
        num_blocks=need_tokens // 256 + len(prompts) + 4,
        max_batch_tokens=args.max_batch_tokens or 2048,
    )
    t0 = time.perf_counter()
    # no inference_mode here: generate_batch runs its own thread and updates tensors in place
    results = model.generate_batch(
        prompts, generation_config=cfg, continuous_batching_config=cb, record_timestamps=True
    )
    wall = time.perf_counter() - t0
    times = [list(r.timestamps or []) for r in results.values()]
    got = sorted(len(r.generated_tokens) for r in results.values())
    if got != [args.new_tokens] * len(prompts):
        raise RuntimeError(
            f"generate_batch returned {got} tokens per request, "
            f"{[r.error for r in results.values() if r.error][:1]}"
        )
    if not any(times):  # no timestamps: count tokens, no latencies
        times = [[t0 + wall] * len(r.generated_tokens) for r in results.values()]
    return summarize(t0, times, wall)


def _engine(args: argparse.Namespace, **overrides: Any) -> Any:
    from services.worker.engine import create_engine
    from services.worker.engine.api import EngineConfig

    settings: dict[str, Any] = {
        "model_path": args.model_path,
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "torch_threads": args.engine_threads,
        "dp_size": args.engine_dp_size,
    }
    settings.update(overrides)
    engine = create_engine(EngineConfig(**settings))
    engine.start()
    return engine


async def _engine_round(
    engine: Any, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[float, list[list[float]], list[Any]]:
    from services.worker.engine.api import EngineRequest, SamplingConfig

    sampling = SamplingConfig(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    times: list[list[float]] = [[] for _ in prompts]
    last: list[Any] = [None] * len(prompts)

    async def one(i: int, handle: Any) -> None:
        async for out in handle:
            now = time.perf_counter()
            times[i].extend([now] * len(out.new_token_ids))
            last[i] = out

    t0 = time.perf_counter()
    dp = engine.config.dp_size
    handles = [
        engine.add_request(EngineRequest(f"{tag}{i}", tuple(p), sampling, dp_rank=i % dp))
        for i, p in enumerate(prompts)
    ]
    await asyncio.gather(*(one(i, h) for i, h in enumerate(handles)))
    return t0, times, last


def run_pdserve(args: argparse.Namespace, prompts: list[list[int]], **overrides: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    engine = _engine(args, enable_prefix_caching=False, **overrides)
    start_s = time.perf_counter() - t_start
    try:

        async def go() -> dict[str, Any]:
            await _engine_round(engine, [prompts[0][:16]], 2, "warm")
            t0, times, _ = await _engine_round(engine, prompts, args.new_tokens, "r")
            result = summarize(t0, times, max(t[-1] for t in times) - t0)
            result["engine_start_s"] = round(start_s, 2)  # load + warm-up of every rank
            return result

        return asyncio.run(go())
    finally:
        engine.shutdown()


def run_pdserve_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve with transformers' own forward (--no-lean-forward): what engine/lean_llama.py gains."""
    return run_pdserve(args, prompts, lean_forward=False)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def run_pdserve_eager(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve without CUDA graphs (--no-cuda-graphs): every decode step launched kernel by kernel."""
    return run_pdserve(args, prompts, cuda_graphs=False)


def run_pdserve_torch(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """CUDA: the same engine on the torch-only path (--no-cuda-kernels: KV gathered per step,
    layers unfused, graphs by batch x context), the baseline of the in-place kernels."""
    return run_pdserve(args, prompts, cuda_kernels=False)


def run_pdserve_no_row_copy(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """pdserve without the CPU row copy (--no-cpu-row-copy): every step on oneDNN's kernel."""
    return run_pdserve(args, prompts, cpu_row_copy=False)


def run_prefix(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Shared 448-token prefix: prefill wall time with and without the prefix cache."""
    rng = random.Random(1)
    vocab = args.vocab_size
    prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_tokens)]
    batch = [prefix + [rng.randrange(100, vocab - 100) for _ in range(64)] for _ in range(args.num_requests)]
    out: dict[str, Any] = {"prefix_tokens": args.prefix_tokens, "requests": len(batch)}
    for label, caching in (("with_cache", True), ("without_cache", False)):
        engine = _engine(args, enable_prefix_caching=caching, dp_size=1)
        try:

            async def go(engine: Any = engine) -> tuple[float, list[Any]]:
                await _engine_round(engine, [prefix + [7] * 8], 1, "w")  # populates the cache
                t0, times, last = await _engine_round(engine, batch, 1, "p")
                return max(t[-1] for t in times) - t0, last

            wall, last = asyncio.run(go())
            load = engine.rank_loads()[0]
        finally:
            engine.shutdown()
        out[label] = {
            "prefill_wall_s": round(wall, 3),
            "cached_tokens": sum(o.num_local_cached_tokens for o in last),
            "prompt_tokens": sum(o.num_prompt_tokens for o in last),
            "hit_rate": round(load.prefix_cache_hit_rate, 4),
        }
    out["speedup"] = round(out["without_cache"]["prefill_wall_s"] / out["with_cache"]["prefill_wall_s"], 2)
    return out


def run_floor(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from benchmarks import engine_floor

    # the workload's mean context in the middle of decoding: mean prompt + half the new tokens
    context = sum(len(p) for p in prompts) // len(prompts) + args.new_tokens // 2
    batches = tuple(int(b) for b in args.floor_batches.split(","))
    return engine_floor.measure(
        args.model_path, args.device, args.dtype, max(1, args.engine_threads), batches, context
    )


RUNNERS = {
    "hf_sequential": run_hf_sequential,
    "hf_padded": run_hf_padded,
    "hf_continuous": run_hf_continuous,
    "pdserve": run_pdserve,
    "pdserve_transformers": run_pdserve_transformers,
    "pdserve_eager": run_pdserve_eager,
    "pdserve_torch": run_pdserve_torch,
    "pdserve_no_row_copy": run_pdserve_no_row_copy,
    "prefix": run_prefix,
    "floor": run_floor,
}


def run_one(args: argparse.Namespace) -> None:
    """Child process: run one contender, write its JSON to args.child_out."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    args.vocab_size = AutoConfig.from_pretrained(args.model_path).vocab_size
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, args.vocab_size)
    result = RUNNERS[args.contender](args, prompts)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    Path(args.child_out).write_text(json.dumps(result))


# ---- parent: run everything, print, write results -------------------------------------------
def _child(args: argparse.Namespace, contender: str, argv: list[str]) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_engine",
            *argv,
            "--contender",
            contender,
            "--child-out",
            str(out),
            "--model-path",
            args.model_path,
        ]
        print(f"-- {contender} ...", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout_s)
        except subprocess.TimeoutExpired:  # a loaded machine: report it, run the others
            print(f"   {contender} timed out after {args.child_timeout_s:.0f} s")
            return None
        if proc.returncode != 0 or not out.exists():
            print(
                f"   {contender} failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}"
            )
            return None
        print(f"   done in {time.perf_counter() - t0:.1f} s", flush=True)
        return dict(json.loads(out.read_text()))


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        "--output", default="", help=f"default {RESULTS} ({RESULTS.stem}-quick.json with --quick)"
    )
    parser.add_argument("--child-timeout-s", type=float, default=900)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt = 4, 16, 64
        args.new_tokens, args.prefix_tokens = 8, 64
    if not args.output:
        args.output = str(RESULTS.with_name("engine-quick.json") if args.quick else RESULTS)
    if args.engine_dp_size <= 0:
        cpu_ranks = min(2, os.cpu_count() or 1)
        args.engine_dp_size = cpu_ranks if args.device == "cpu" else 1
    if args.engine_threads < 0:
        args.engine_threads = 1 if args.device == "cpu" and args.engine_dp_size > 1 else args.threads
    if args.contender:
        run_one(args)
        return

    from shared.model_store import resolve_model

    args.model_path = str(resolve_model(args.model))
    child_argv = [
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
    ]
    print(
        f"model {args.model_path}, {args.device} {args.dtype}, {args.num_requests} requests, "
        f"prompts {args.min_prompt}-{args.max_prompt}, {args.new_tokens} new tokens, "
        f"{os.cpu_count()} CPUs"
    )
    results: dict[str, dict[str, Any] | None] = {}
    for name in args.contenders.split(","):
        if name in ("pdserve_eager", "pdserve_torch") and args.device != "cuda":
            continue  # the same engine as pdserve off CUDA
        if name == "pdserve_no_row_copy" and args.device != "cpu":
            continue  # the row copy is a CPU kernel
        results[name] = _child(args, name, child_argv)
    prefix = None if args.no_prefix_run else _child(args, "prefix", child_argv)
    floor = None if args.no_floor_run else _child(args, "floor", child_argv)

    print(
        f"\n{'contender':<15}{'tok/s':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'RSS MiB':>9}"
    )
    for name, r in results.items():
        if r is None:
            print(f"{name:<15}{'(not run)':>8}")
            continue
        print(
            f"{name:<15}{r['tokens_per_s']:>8.1f}{_fmt(r['ttft_ms_p50'], 0):>10}"
            f"{_fmt(r['ttft_ms_p99'], 0):>9}{_fmt(r['tpot_ms_p50']):>10}"
            f"{_fmt(r['tpot_ms_p99']):>8}{r['peak_rss_mib']:>9.0f}"
        )
    tps = {k: (v["tokens_per_s"] if v else None) for k, v in results.items()}
    ours = tps.get("pdserve")

    def ratio(base: str) -> float | None:
        return _ratio(ours, tps.get(base))

    ratios = {
        "ratio_vs_hf_sequential": ratio("hf_sequential"),
        "ratio_vs_hf_padded": ratio("hf_padded"),
        "ratio_vs_hf_continuous": ratio("hf_continuous"),
        # the lean forward (default) over transformers' module tree, same engine otherwise (on
        # CUDA both without graphs, which need the lean forward: pdserve_eager's rate)
        "ratio_lean_vs_transformers_forward": _ratio(
            tps.get("pdserve_eager") or ours, tps.get("pdserve_transformers")
        ),
    }
    if tps.get("pdserve_eager"):
        ratios["ratio_cuda_graphs_vs_eager"] = ratio("pdserve_eager")
    if tps.get("pdserve_torch"):
        ratios["ratio_cuda_kernels_vs_torch_path"] = ratio("pdserve_torch")
    if tps.get("pdserve_no_row_copy"):
        ratios["ratio_row_copy_vs_onednn_only"] = ratio("pdserve_no_row_copy")
    print("\n" + "  ".join(f"{k} {_fmt(v, 2)}" for k, v in ratios.items()))
    if prefix is not None:
        w, wo = prefix["with_cache"], prefix["without_cache"]
        print(
            f"prefix-heavy ({prefix['requests']} x {prefix['prefix_tokens']}-token shared "
            f"prefix + 64): prefill {wo['prefill_wall_s']:.2f} s without cache, "
            f"{w['prefill_wall_s']:.2f} s with (hit rate {w['hit_rate']:.1%}): "
            f"{prefix['speedup']:.2f}x"
        )
    graphs = " + CUDA graph capture" if args.device == "cuda" else ""
    for name, what in (("pdserve", f"load + warm-up{graphs}"), ("pdserve_eager", "load + warm-up")):
        if (r := results.get(name)) is not None:
            print(f"{name} engine start ({what}, {args.engine_dp_size} rank(s)): {r['engine_start_s']:.1f} s")
    if floor is not None:
        from benchmarks.engine_floor import format_report

        print("\n".join(format_report(floor)))
    report = {
        "tokens_per_s": tps,
        **ratios,
        "cpu": floor["cpu"] if floor else None,
        "decode_step_vs_floor": floor["decode_step_vs_floor"] if floor else None,
        "floor": floor,
        "prefix_heavy": prefix,
        "config": {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "num_requests": args.num_requests,
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "new_tokens": args.new_tokens,
            "quick": args.quick,
            "threads": args.threads,
            "engine_dp_size": args.engine_dp_size,
            "engine_threads": args.engine_threads,
        },
        "details": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
