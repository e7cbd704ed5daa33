"""The transformers contenders: `generate` one request at a time, one padded batch, and
continuous batching (`generate_batch`), each on the same model, device and dtype as the engine."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.engine.workload import summarize


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
