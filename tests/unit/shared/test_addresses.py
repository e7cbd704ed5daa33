"""host:port normalization: IPv6 hosts get brackets, everything else is left alone."""

from __future__ import annotations

import pytest

from shared.addresses import normalize_address


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("fd00::1:50061", "[fd00::1]:50061"),  # $(POD_IP):port on an IPv6 cluster
        ("[fd00::1]:50061", "[fd00::1]:50061"),
        ("2001:db8::a:b:8080", "[2001:db8::a:b]:8080"),
        ("10.0.0.7:50061", "10.0.0.7:50061"),
        ("worker-0.pdserve:50071", "worker-0.pdserve:50071"),
    ],
)
def test_normalize_address(given: str, want: str) -> None:
    assert normalize_address(given) == want


@pytest.mark.parametrize("bad", ["10.0.0.7", ":50061", "host:", "host:port"])
def test_addresses_without_a_port_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        normalize_address(bad)
