"""What a request's unset sampling fields become: the model creator's recommendation in the served
model's generation_config.json (vLLM's default `--generation-config auto`), else OpenAI's
defaults (temperature 1, no top-p / top-k / min-p cut, no repetition penalty).

vLLM reads exactly these keys of the file, and so does pdserve: `temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty`, and `max_new_tokens` (the default max_tokens). Without them a
model served by pdserve and by vLLM would sample differently for the same request (Llama 3.1
Instruct ships temperature 0.6 and top_p 0.9, Qwen2.5 also top_k 20 and repetition_penalty 1.05).
A value out of its range is left out with a warning. No grpc here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """The values unset request fields take (OpenAI's, unless a model's file says otherwise)."""

    temperature: float = 1.0
    top_p: float = 1.0  # 1 = no cut
    top_k: int = 0  # 0 = no cut
    min_p: float = 0.0  # 0 = no cut
    repetition_penalty: float = 1.0  # 1 = off
    max_tokens: int | None = None  # None: the gateway's --default-max-tokens

    @classmethod
    def of_model(cls, folder: Path) -> SamplingDefaults:
        """The defaults a model folder's generation_config.json recommends (OpenAI's where it
        is silent, unreadable or out of range)."""
        path = folder / "generation_config.json"
        try:
            raw: Any = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            log.warning("generation_config_unreadable", path=str(path), error=str(exc))
            return cls()
        if not isinstance(raw, dict):
            return cls()
        found: dict[str, Any] = {}
        for name, value in raw.items():
            key = "max_tokens" if name == "max_new_tokens" else name
            if key not in _CHECKS or value is None:
                continue
            checked = _CHECKS[key](value)
            if checked is None:
                log.warning("generation_config_value_ignored", key=name, value=value)
            else:
                found[key] = checked
        defaults = cls(**found)
        if found:
            log.info("sampling_defaults_from_model", path=str(path), **found)
        return defaults

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _number(lo: float, hi: float, lo_open: bool = False) -> Any:
    def check(value: Any) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        if value < lo or value > hi or (lo_open and value == lo):
            return None
        return float(value)

    return check


def _count(lo: int) -> Any:
    def check(value: Any) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            return None
        return value

    return check


# the ranges the gateway's own validation accepts for the same request fields
_CHECKS = {
    "temperature": _number(0.0, math.inf),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "top_k": _count(0),
    "min_p": _number(0.0, 1.0),
    "repetition_penalty": _number(0.0, 2.0, lo_open=True),
    "max_tokens": _count(1),
}
