"""Reference outputs from transformers' own `generate` (greedy, fp32), for token-identity checks."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=4)
def _load(folder: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def hf_greedy(folder: str | Path, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids`, cut before the first EOS (EOS itself not included)."""
    import torch

    model, tokenizer = _load(str(folder))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    generated = out[0, len(prompt_ids) :].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    for i, tok in enumerate(generated):
        if tok in eos_ids:
            return generated[:i]
    return generated


def tokenize(
    folder: str | Path, text: str | None = None, messages: list[dict[str, str]] | None = None
) -> list[int]:
    """Token ids as the gateway computes them (raw prompt, or chat template + generation prompt)."""
    _model, tokenizer = _load(str(folder))
    if messages is not None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def eos_ids(folder: str | Path) -> set[int]:
    model, _tok = _load(str(folder))
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
