"""What a model's attention is, read from its config the way transformers reads it: the one place
that knows each family's sliding-window fields, and the variants the engine refuses.

- `attention_windows(config)`: per layer, the number of most recent keys a query sees (itself
  included), or None for full causal attention. transformers masks a windowed layer with
  `kv_idx > q_idx - sliding_window` (masking_utils.sliding_window_overlay): a query at position p
  sees keys p - W + 1 .. p.
- `check_supported(config)`: raises `UnsupportedAttention` (one line naming the config field)
  for an attention the engine cannot reproduce exactly, so a worker exits at start instead of
  serving different tokens than transformers would.

Honoured without code here: scaling overrides (`query_pre_attn_scalar`, `attention_multiplier`:
the model passes its own `scaling` to the attention function), logit soft-capping
(`attn_logit_softcapping`: the model passes `softcap`, attention.py computes it as transformers'
eager attention does; `final_logit_softcapping` is applied by the model's own head).
"""

from __future__ import annotations

from typing import Any

import torch

# Families whose modeling code masks every layer with `config.sliding_window` (when not None)
# and ignores `layer_types` (transformers' Mistral warns that it does).
_UNIFORM_WINDOW = frozenset({"mistral", "mixtral", "phi3", "qwen3_moe", "qwen2_moe", "starcoder2"})
# Families whose modeling code never windows, whatever stray fields their configs carry.
_NO_WINDOW = frozenset({"llama", "olmo", "olmo2", "granite"})
# Layer types of `layer_types` the engine serves.
_FULL, _SLIDING = "full_attention", "sliding_attention"
# Families whose attention has a term the engine does not compute, by the field or feature.
_REFUSED_FAMILIES = {
    "gpt_oss": "attention sinks (learned per-head sink logits, the 'sinks' weights)",
}


class UnsupportedAttention(ValueError):
    """The model's attention cannot be reproduced exactly by the engine (a configuration problem:
    the worker reports it in one line and exits)."""


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal config's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _window_value(cfg: Any) -> int:
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UnsupportedAttention(
            f"model config field sliding_window={window!r}: windowed layers need a positive integer window"
        )
    return window


def attention_windows(config: Any) -> list[int | None]:
    """Per layer: its attention window in tokens (a query sees that many most recent keys,
    itself included), or None for full causal attention. Raises UnsupportedAttention for layer
    types other than full and sliding attention."""
    cfg = text_config(config)
    num_layers = int(getattr(cfg, "num_hidden_layers", 0))
    model_type = str(getattr(cfg, "model_type", ""))
    if model_type in _NO_WINDOW:
        return [None] * num_layers
    if model_type in _UNIFORM_WINDOW:
        if getattr(cfg, "sliding_window", None) is None:
            return [None] * num_layers
        window = _window_value(cfg)
        return [window] * num_layers
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        types = list(layer_types)
        unknown = sorted({t for t in types if t not in (_FULL, _SLIDING)})
        if unknown:
            raise UnsupportedAttention(
                f"model config field layer_types contains {', '.join(map(repr, unknown))}: "
                f"only {_FULL!r} and {_SLIDING!r} layers are supported"
            )
        if len(types) < num_layers:
            raise UnsupportedAttention(
                f"model config field layer_types has {len(types)} entries for {num_layers} layers"
            )
        if _SLIDING not in types[:num_layers]:
            return [None] * num_layers
        window = _window_value(cfg)
        return [window if t == _SLIDING else None for t in types[:num_layers]]
    if getattr(cfg, "sliding_window", None) is not None:  # the older convention: every layer
        window = _window_value(cfg)
        return [window] * num_layers
    return [None] * num_layers


def kv_window_tokens(config: Any) -> int | None:
    """The longest window when every layer has one, else None: a request's KV blocks wholly
    behind it are never read again (freed early, as vLLM's sliding-window manager does)."""
    windows = attention_windows(config)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def attention_softcap(config: Any) -> float | None:
    """The attention logit soft-cap (scores -> cap * tanh(scores / cap)), or None."""
    cap = getattr(text_config(config), "attn_logit_softcapping", None)
    return None if cap is None else float(cap)


def check_supported(config: Any) -> None:
    """Raise UnsupportedAttention (one line naming the config field) unless every layer's
    attention is one the engine computes exactly: causal, full or windowed, optionally
    soft-capped, with the model's own scaling."""
    cfg = text_config(config)
    model_type = str(getattr(cfg, "model_type", ""))
    if model_type in _REFUSED_FAMILIES:
        raise UnsupportedAttention(
            f"model_type {model_type!r}: {_REFUSED_FAMILIES[model_type]} is not supported"
        )
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None:
        raise UnsupportedAttention(
            f"model config field attention_chunk_size={chunk!r}: chunked local attention is not supported"
        )
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedAttention(
            "model config field use_bidirectional_attention=True: only causal attention is supported"
        )
    cap = getattr(cfg, "attn_logit_softcapping", None)
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
        raise UnsupportedAttention(
            f"model config field attn_logit_softcapping={cap!r}: a soft-cap must be a positive number"
        )
    attention_windows(config)  # raises for unknown layer types or a bad window


def check_loaded(model: Any) -> None:
    """The loaded model's attention modules hold nothing the engine ignores (sink logits)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            raise UnsupportedAttention(
                f"model module {name} has attention sinks ('sinks' weights): not supported"
            )
