"""API keys: bearer parsing, constant-time acceptance of any configured key, key files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.auth import ApiKeys, bearer_token, load_api_keys


def test_no_keys_means_open() -> None:
    keys = ApiKeys.of([])
    assert not keys.enabled and keys.accepts(None) and keys.accepts("Bearer anything")


def test_accepts_any_configured_key_only_as_bearer() -> None:
    keys = ApiKeys.of(["k1", " k2 ", ""])
    assert len(keys) == 2
    assert keys.accepts("Bearer k1") and keys.accepts("bearer k2") and keys.accepts("  Bearer   k2 ")
    for bad in (None, "", "k1", "Bearer", "Bearer k3", "Basic k1", "Bearer k1x", "Bearer k", "Bearer ключ"):
        assert not keys.accepts(bad), bad


def test_bad_keys_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError) as err:
        ApiKeys.of(["good", "has space"])
    assert "has space" not in str(err.value) and "#2" in str(err.value)
    assert "sekrit" not in repr(ApiKeys.of(["sekrit"]))


def test_key_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\n  beta  \n")
    keys = load_api_keys(["gamma"], str(f))
    assert len(keys) == 3 and all(keys.accepts(f"Bearer {k}") for k in ("alpha", "beta", "gamma"))
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys([], str(f))
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys([], str(tmp_path / "missing"))


@given(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64))
def test_every_printable_key_round_trips(key: str) -> None:
    keys = ApiKeys.of([key])
    assert keys.accepts(f"Bearer {key}")
    assert bearer_token(f"Bearer {key}") == key
    assert not keys.accepts(f"Bearer {key}x")
