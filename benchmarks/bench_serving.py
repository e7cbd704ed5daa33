"""TPOT of the whole stack against the decode floor (issue 31): `pdserve up` (unified, then
disaggregated), chat completions streamed over the OpenAI-compatible HTTP API, first one request
at a time, then `--burst` requests at once; each request a prompt of `--prompt-tokens` tokens and
exactly `--max-tokens` new ones (EOS ignored), greedy.

The floor of a decode step is its bytes over the device's measured read bandwidth: every weight
once (as engine_floor.py counts them, from the model's shape on the meta device) plus the K/V of
every running sequence at the middle of its generation. Reported: TTFT and TPOT p50 per phase,
TPOT over the 1-sequence floor (one at a time) and over the burst-size floor (all at once).

    python -m benchmarks.bench_serving --model random:llama-8b --device cuda [--configs unified,disaggregated]

A configuration may add `+`-separated modifiers: `+<N>gw` (`unified+2gw`): `pdserve up --gateways
N`, N gateway processes sharing the HTTP port; `+graphs` (`disaggregated+graphs`): CUDA graphs in every
worker (`pdserve up` keeps the decode and unified workers' and gives prefill workers none),
`+eager`: none in any worker.
Each phase records the CPU µs per delivered token of every service (all gateways summed under
`gateway`), the engine steps each worker ran by kind (decode / mixed / prefill / verify:
count, mean wall time, tokens per step; engine_steps.py, from the workers' /metrics; on a GPU
also the allocations its allocator retried, `gpu_alloc_retries`, and on any device the frames
torch.compile compiled, `torch_compiles`: each a stalled step), and the
gateways' split of its TTFT (`ttft_phases_ms`: schedule, admit, prefill, mean ms).

Writes benchmarks/results/serving-<device>.json (with the GPU's name, or the CPU's capability).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import engine_steps, process_cpu
from benchmarks.bench_stack import gateway_ttft_phases, ttft_phases_ms
from benchmarks.engine_floor import cpu_features, cuda_bandwidth, read_bandwidth, weight_bytes_per_step
from benchmarks.goodput import loadgen, workloads
from benchmarks.goodput.stats import RequestResult
from benchmarks.result_names import machine_class
from services.up_shape import GATEWAY_REPLICA_OFFSET, PORT_OFFSETS
from shared.model_store import resolve_model
from tests.support.stack import running_stack

RESULTS = Path(__file__).parent / "results"


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 2) if values else None


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "ttft_ms_p50": _p50([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms_p50": _p50([t for r in ok if (t := r.tpot_s) is not None]),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 3),  # against the engine steps' seconds: the rest is idle
        "errors": sorted({r.error[:200] for r in results if not r.ok}),
    }


def floors_ms(model_path: Path, device: str, context: int, batches: list[int]) -> dict[str, Any]:
    """Decode-step floors (ms) per batch size at `context` cached tokens per sequence."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else None)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    elem = 2 if device == "cuda" else 4
    kv_per_token = text.num_hidden_layers * 2 * kv_heads * head_dim * elem
    if device == "cuda":
        bandwidth = cuda_bandwidth(torch.device("cuda"))
        torch.cuda.empty_cache()
    else:
        bandwidth = read_bandwidth(1)
    out: dict[str, Any] = {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "context_tokens": context}
    for b in batches:
        nbytes = weight_bytes_per_step(model, b) + b * context * kv_per_token
        out[str(b)] = round(nbytes / bandwidth * 1e3, 3)
    return out


def requests(count: int, prompt_tokens: int, max_tokens: int, tag: str, tokenizer: Any) -> list[Any]:
    corpus = workloads.load_corpus()
    rng = random.Random(f"serving:{tag}")
    return [
        workloads.Request(
            index=i,
            messages=({"role": "user", "content": workloads._text(rng, corpus, tokenizer, prompt_tokens)},),
            max_tokens=max_tokens,
            message_tokens=prompt_tokens,
        )
        for i in range(count)
    ]


async def run_config(stack: Any, a: argparse.Namespace, tokenizer: Any, gateways: int = 1) -> dict[str, Any]:
    model = await loadgen.served_model(stack.http_base_url) or "default"
    target = loadgen.Target(stack.http_base_url, model, ignore_eos=True, request_timeout_s=600)
    # warm-up, not counted: short and full-length prompts one at a time, then a few full-length
    # ones at once (a burst's mixed steps), so no phase pays a first use of its step shapes
    await loadgen.run_sequential(target, requests(2, 32, 8, "warm", tokenizer))
    await loadgen.run_sequential(target, requests(1, a.prompt_tokens, 8, "warm-long", tokenizer))
    together = requests(min(a.burst, 8), a.prompt_tokens, 8, "warm-burst", tokenizer)
    await loadgen.run_open_loop(target, together, rate_rps=1e6, seed=0, max_send_s=60)
    out: dict[str, Any] = {}
    workers = ("worker",) if stack.unified else ("prefill-worker", "decode-worker")
    urls = {w: stack.metrics_url(PORT_OFFSETS[w]) for w in workers}
    # the gateways' split of each phase's TTFT (where a burst's first tokens wait)
    gateway_urls = [stack.metrics_url(PORT_OFFSETS["gateway"])] + [
        stack.metrics_url(GATEWAY_REPLICA_OFFSET + i) for i in range(1, gateways)
    ]
    steps0 = await asyncio.to_thread(engine_steps.snapshot, urls)
    split0 = await asyncio.to_thread(gateway_ttft_phases, gateway_urls)
    # Each phase records the CPU µs per delivered token of every service (and the workers' split:
    # event loop vs engine step thread): on a host whose GPU outruns its CPUs, the largest of
    # these (times the tokens per step) bounds the step time from below.
    mark0, t0 = process_cpu.mark(stack.pid), time.perf_counter()
    seq = await loadgen.run_sequential(
        target, requests(a.sequential, a.prompt_tokens, a.max_tokens, "one", tokenizer)
    )
    one = out["one_at_a_time"] = summarize(seq, time.perf_counter() - t0)
    mark1 = process_cpu.mark(stack.pid)
    one.update(process_cpu.per_token(mark0, mark1, one["completion_tokens"]))
    steps1 = await asyncio.to_thread(engine_steps.snapshot, urls)
    one["engine_steps"] = engine_steps.delta(steps0, steps1)
    split1 = await asyncio.to_thread(gateway_ttft_phases, gateway_urls)
    one["ttft_phases_ms"] = ttft_phases_ms(split0, split1)
    # every request sent at once (an arrival rate no gap can follow), from --clients processes
    burst, client_s, wall_s = await asyncio.to_thread(
        loadgen.run_all_at_once,
        target,
        requests(a.burst, a.prompt_tokens, a.max_tokens, "burst", tokenizer),
        a.clients,
    )
    many = out[f"{a.burst}_at_once"] = summarize(burst, wall_s)
    many.update(process_cpu.per_token(mark1, process_cpu.mark(stack.pid), many["completion_tokens"]))
    many["cpu_us_per_token"]["clients"] = round(client_s / max(1, many["completion_tokens"]) * 1e6, 1)
    many["clients"] = a.clients
    many["engine_steps"] = engine_steps.delta(steps1, await asyncio.to_thread(engine_steps.snapshot, urls))
    split2 = await asyncio.to_thread(gateway_ttft_phases, gateway_urls)
    many["ttft_phases_ms"] = ttft_phases_ms(split1, split2)
    return out


def config_args(config: str) -> tuple[str, list[str]]:
    """A configuration's stack shape (`unified` / `disaggregated`) and the `pdserve up` flags its
    modifiers add: `+<N>gw` gateways, `+graphs` / `+eager` CUDA graphs in every / no worker."""
    shape, *mods = config.split("+")
    if shape not in ("unified", "disaggregated"):
        raise ValueError(
            f"unknown configuration {config!r}: unified or disaggregated, then +Ngw / +graphs / +eager"
        )
    args = ["--gateways", "1"]
    for mod in mods:
        if re.fullmatch(r"[1-9]gw", mod):
            args[1] = mod.removesuffix("gw")
        elif mod == "graphs":
            args.append("--worker-arg=--cuda-graphs")
        elif mod == "eager":
            args.append("--worker-arg=--no-cuda-graphs")
        else:
            raise ValueError(f"unknown modifier {mod!r} in {config!r}: +Ngw, +graphs or +eager")
    return shape, args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-8b")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--configs", default="unified,disaggregated")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sequential", type=int, default=3)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument(
        "--clients",
        type=int,
        default=1 if (os.cpu_count() or 1) <= 4 else 4,
        help="client processes sending the burst (default 4 on hosts of more than 4 CPUs: one "
        "httpx client reads ~100-200 us of CPU per token, so one core would cap the rate it sees)",
    )
    ap.add_argument("--up-arg", action="append", default=[], help="extra `pdserve up` argument")
    ap.add_argument("--ready-timeout-s", type=float, default=900)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    for config in a.configs.split(","):
        try:
            config_args(config)
        except ValueError as exc:
            ap.error(str(exc))
    from benchmarks.bench_goodput import load_tokenizer

    path = resolve_model(a.model)
    tokenizer = load_tokenizer(str(path))
    context = a.prompt_tokens + a.max_tokens // 2
    floors = floors_ms(path, a.device, context, [1, a.burst])
    print("floors (ms):", floors, flush=True)
    if a.device == "cuda":
        machine: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
        name = re.sub(r"[^a-z0-9]+", "-", machine["gpu"].lower()).strip("-")
    else:
        machine = cpu_features()
        name = machine_class("cpu")
    doc: dict[str, Any] = {
        "machine": machine,
        "model": a.model,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "floors_ms": floors,
        "configs": {},
        "command": "python -m benchmarks.bench_serving "
        + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("out", "up_arg")),
    }
    up_args = ["--device", a.device, "--dtype", a.dtype, *a.up_arg]
    out = a.out or RESULTS / f"serving-{name}.json"
    for config in a.configs.split(","):
        shape, config_up_args = config_args(config)
        print(f"[{config}] starting", flush=True)
        with tempfile.TemporaryDirectory() as logs:
            t0 = time.perf_counter()
            try:
                with running_stack(
                    str(path),
                    Path(logs),
                    unified=shape == "unified",
                    up_args=[*up_args, *config_up_args],
                    ready_timeout_s=a.ready_timeout_s,
                    metrics=True,  # the workers' engine steps by kind
                ) as stack:
                    start_s = round(time.perf_counter() - t0, 1)
                    gateways = int(config_up_args[config_up_args.index("--gateways") + 1])
                    result = asyncio.run(run_config(stack, a, tokenizer, gateways))
            except RuntimeError as exc:  # the stack did not start: that is a result too
                result = {"error": str(exc)[-3000:]}
                start_s = None
        result["start_s"] = start_s
        one = result.get("one_at_a_time", {})
        many = result.get(f"{a.burst}_at_once", {})
        if one.get("tpot_ms_p50"):
            result["tpot_vs_floor_1"] = round(one["tpot_ms_p50"] / floors["1"], 2)
        if many.get("tpot_ms_p50"):
            result[f"tpot_vs_floor_{a.burst}"] = round(many["tpot_ms_p50"] / floors[str(a.burst)], 2)
        print(f"[{config}]", json.dumps(result), flush=True)
        doc["configs"][config] = result
        # after each configuration: a run stopped by its time limit (a GPU window) keeps those done
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
