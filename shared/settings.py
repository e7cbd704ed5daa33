"""Typed settings from flags and PDSERVE_* environment variables (the only reader of the environment).

Each service declares one frozen dataclass of settings; every field becomes a flag
(`--field-name`) and an environment variable (`PDSERVE_FIELD_NAME`). Precedence: flag > env >
default. Helm values become env vars, so a deployment never needs flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

ENV_PREFIX = "PDSERVE_"


def field(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    repeatable: bool = False,
    aliases: Sequence[str] = (),
    secret: bool = False,
) -> Any:
    """A settings field with its help text (and allowed values).

    repeatable: a tuple field whose flag may be given several times (each one value, taken as is);
    its environment variable is still comma-separated. aliases: extra flag names ("api-key").
    secret: kept out of the dataclass repr, so that logging the settings never shows it."""
    return dataclasses.field(
        default=default,
        repr=not secret,
        metadata={"help": help, "choices": choices, "repeatable": repeatable, "aliases": tuple(aliases)},
    )


def _base_type(tp: Any) -> Any:
    """`int | None` -> int; `tuple[str, ...]` -> tuple; plain types unchanged."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return origin or tp


def _convert(raw: str, tp: Any, name: str) -> Any:
    base = _base_type(tp)
    if isinstance(base, type) and issubclass(base, enum.Enum):  # by value: "prefill" -> Role.PREFILL
        try:
            return base(raw.strip())
        except ValueError:
            allowed = [m.value for m in base]
            raise ValueError(f"{name}: {raw!r} is not one of {allowed}") from None
    if base is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if base is tuple:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    if raw == "" and typing.get_origin(tp) in (typing.Union, types.UnionType):
        return None
    try:
        return base(raw)
    except ValueError as exc:
        raise ValueError(f"{name}: cannot parse {raw!r} as {base.__name__}") from exc


def parse_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Build `cls` (a dataclass) from argv (None = sys.argv[1:]), then env, then defaults.

    Unknown env vars are ignored."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        flags = ["--" + f.name.replace("_", "-"), *("--" + a for a in f.metadata.get("aliases", ()))]
        env_name = ENV_PREFIX + f.name.upper()
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        help_text = f"{f.metadata.get('help', '')} (env {env_name}; default {default!r})"
        if _base_type(hints[f.name]) is bool:
            parser.add_argument(
                *flags, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif f.metadata.get("repeatable"):
            parser.add_argument(*flags, dest=f.name, default=None, action="append", help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, default=None, type=str, help=help_text)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        cli_value = getattr(args, f.name)
        env_value = env.get(ENV_PREFIX + f.name.upper())
        value: Any
        try:
            if isinstance(cli_value, list):  # a repeatable flag: each occurrence is one value
                value = tuple(cli_value)
            elif cli_value is not None:
                value = cli_value if isinstance(cli_value, bool) else _convert(cli_value, tp, f.name)
            elif env_value is not None:
                value = _convert(env_value, tp, f.name)
            else:
                continue
        except ValueError as exc:
            parser.error(str(exc))
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            parser.error(f"--{f.name.replace('_', '-')}: {value!r} is not one of {list(choices)}")
        values[f.name] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def otel_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The standard OTEL_* variables (read here so that nothing else reads the environment)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith("OTEL_")}
