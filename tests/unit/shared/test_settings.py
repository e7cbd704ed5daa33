"""Settings: flags beat env beat defaults; types and choices are checked."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shared.settings import field, parse_settings


@dataclass(frozen=True)
class DemoSettings:
    """Demo."""

    listen: str = field("0.0.0.0:1", "address")
    workers: int = field(2, "count")
    ratio: float = field(0.5, "ratio")
    verbose: bool = field(False, "flag")
    policy: str = field("a", "policy", choices=["a", "b"])
    names: tuple[str, ...] = field((), "names")
    limit: int | None = field(None, "optional")


def test_defaults_when_nothing_given() -> None:
    s = parse_settings(DemoSettings, [], env={})
    assert s == DemoSettings()


def test_env_then_flag_precedence() -> None:
    env = {"PDSERVE_WORKERS": "5", "PDSERVE_LISTEN": "h:2", "PDSERVE_VERBOSE": "true"}
    s = parse_settings(DemoSettings, ["--workers", "7"], env=env)
    assert (s.workers, s.listen, s.verbose) == (7, "h:2", True)


def test_types_tuple_optional_and_bool_flags() -> None:
    s = parse_settings(
        DemoSettings, ["--names", "x, y", "--limit", "3", "--no-verbose"], env={"PDSERVE_VERBOSE": "1"}
    )
    assert s.names == ("x", "y")
    assert s.limit == 3
    assert s.verbose is False


def test_unknown_env_vars_are_ignored() -> None:
    assert parse_settings(DemoSettings, [], env={"PDSERVE_NOT_A_FIELD": "x"}) == DemoSettings()


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--workers", "many"], {}), (["--policy", "c"], {}), ([], {"PDSERVE_VERBOSE": "maybe"})],
)
def test_bad_values_exit_with_a_message(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(DemoSettings, argv, env=env)
    assert exc.value.code == 2


@dataclass(frozen=True)
class KeySettings:
    """Keys."""

    api_keys: tuple[str, ...] = field((), "keys", repeatable=True, aliases=("api-key",), secret=True)


def test_repeatable_flag_alias_and_env() -> None:
    s = parse_settings(KeySettings, ["--api-key", "a,b", "--api-key", "c"], env={"PDSERVE_API_KEYS": "x"})
    assert s.api_keys == ("a,b", "c")  # each flag is one value, taken as is; flags beat env
    assert parse_settings(KeySettings, [], env={"PDSERVE_API_KEYS": "x, y"}).api_keys == ("x", "y")
    assert parse_settings(KeySettings, ["--api-keys", "z"], env={}).api_keys == ("z",)


def test_secret_fields_stay_out_of_repr() -> None:
    assert "sekrit" not in repr(parse_settings(KeySettings, ["--api-key", "sekrit"], env={}))
