"""What serving through LoRA adapters costs (`--lora-modules`): one engine with `--adapters`
random rank-`--rank` adapters on every projection, the same workload served four ways in one run:

  base      every request on the base model (adapters loaded, unused: the floor)
  one       every request through the same adapter (one delta over all rows)
  mixed     requests spread over the base model and every adapter (per-adapter row groups)
  prefill   TTFT of one `--prompt-tokens` prompt, base and through an adapter

Decode: `--batch` requests at once (prompt `--decode-prompt` tokens, `--new-tokens` out, greedy,
ignore_eos); TPOT per request = (last token time - first token time) / (tokens - 1), the median
over requests, repeated `--repeats` times (median of medians). Ratios to `base` are the cost.
The adapters are written as PEFT folders (adapter_config.json + adapter_model.safetensors) of
the model's shapes, random, so nothing is downloaded.

    python -m benchmarks.lora [--model random:smollm2] [--device cpu] [--batch 8]

Writes benchmarks/results/lora-<machine class>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.result_names import describe_machine, result_path

_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_random_adapter(model_dir: Path, folder: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for the Llama-shaped model in `model_dir`: every projection of every
    layer, random A and B (std 0.02), lora_alpha = 2 x rank."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = (
        int(cfg["num_attention_heads"]),
        int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
    )
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    dims = {  # (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for part, names in _PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = dims[name]
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for names in _PROJECTIONS.values() for n in names],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


async def _timed(engine: Any, request: Any) -> tuple[float, float, int]:
    """(first token time, last token time, tokens) of one request, perf_counter seconds."""
    first = last = 0.0
    tokens = 0
    async for out in engine.add_request(request):
        if out.new_token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(out.new_token_ids)
    return first, last, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.worker.engine import create_engine
    from services.worker.engine.api import EngineConfig, EngineRequest, SamplingConfig
    from shared.model_store import resolve_model

    model_dir = resolve_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    names = [f"a{i}" for i in range(args.adapters)]
    specs = tuple(
        f"{n}={write_random_adapter(model_dir, tmp / n, args.rank, i)}" for i, n in enumerate(names)
    )
    engine = create_engine(
        EngineConfig(
            model_path=str(model_dir),
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=max(args.batch, 8),
            torch_threads=args.threads,
            lora_modules=specs,
            enable_prefix_caching=False,  # every visit computes its prompt
        )
    )
    engine.start()
    rng = random.Random(3)
    vocab = min(int(getattr(engine, "vocab_size", 0)) or 49152, 40000)

    def sampling(adapter: str, new_tokens: int) -> SamplingConfig:
        return SamplingConfig(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, lora_adapter=adapter)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    ways = {
        "base": [""] * args.batch,
        "one": [names[0]] * args.batch,
        "mixed": [["", *names][i % (len(names) + 1)] for i in range(args.batch)],
    }
    results: dict[str, Any] = {}
    seq = iter(range(1 << 30))

    async def decode_way(adapters: list[str]) -> float:
        reqs = [
            EngineRequest(f"d{next(seq)}", prompt(args.decode_prompt), sampling(a, args.new_tokens))
            for a in adapters
        ]
        runs = await asyncio.gather(*(_timed(engine, r) for r in reqs))
        return statistics.median((last - first) / max(1, n - 1) for first, last, n in runs)

    async def ttft(adapter: str) -> float:
        t0 = time.perf_counter()
        first, _, _ = await _timed(
            engine, EngineRequest(f"p{next(seq)}", prompt(args.prompt_tokens), sampling(adapter, 1))
        )
        return first - t0

    async def measure() -> None:
        await decode_way(ways["mixed"])  # warm-up: every adapter's path once
        for way, adapters in ways.items():
            tpots = [await decode_way(adapters) for _ in range(args.repeats)]
            results[way] = {
                "tpot_ms": round(statistics.median(tpots) * 1e3, 3),
                "tpot_ms_runs": [round(t * 1e3, 3) for t in tpots],
            }
        for way, adapter in (("prefill_base", ""), ("prefill_adapter", names[0])):
            times = [await ttft(adapter) for _ in range(args.repeats)]
            results[way] = {
                "ttft_ms": round(statistics.median(times) * 1e3, 2),
                "ttft_ms_runs": [round(t * 1e3, 2) for t in times],
            }

    try:
        asyncio.run(measure())
    finally:
        engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2", help="random:<shape>, default or a folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="requests decoded at once")
    parser.add_argument(
        "--decode-prompt", type=int, default=128, help="tokens of each decoded request's prompt"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the TTFT prompt (tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="", help="default benchmarks/results/lora-<class>.json")
    args = parser.parse_args(argv)
    rows = run(args)
    base = rows["base"]["tpot_ms"]
    ratios = {
        "one_adapter_tpot_over_base": round(rows["one"]["tpot_ms"] / base, 3),
        "mixed_tpot_over_base": round(rows["mixed"]["tpot_ms"] / base, 3),
        "adapter_ttft_over_base": round(
            rows["prefill_adapter"]["ttft_ms"] / rows["prefill_base"]["ttft_ms"], 3
        ),
    }
    for way in ("base", "one", "mixed"):
        print(f"decode {way:6s} TPOT {rows[way]['tpot_ms']:8.3f} ms  {rows[way]['tpot_ms_runs']}")
    for way in ("prefill_base", "prefill_adapter"):
        print(f"{way:16s} TTFT {rows[way]['ttft_ms']:8.2f} ms  {rows[way]['ttft_ms_runs']}")
    print("ratios:", ratios)
    machine = describe_machine(args.device)
    doc = {
        "command": "python -m benchmarks.lora " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "model": args.model,
        "workload": {
            k: getattr(args, k)
            for k in (
                "adapters",
                "rank",
                "batch",
                "decode_prompt",
                "new_tokens",
                "prompt_tokens",
                "repeats",
                "dtype",
            )
        },
        "results": rows,
        "ratios": ratios,
    }
    out = Path(args.out) if args.out else result_path("lora", args.device)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
