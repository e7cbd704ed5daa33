"""host:port strings as gRPC targets need them (IPv6 hosts in brackets)."""

from __future__ import annotations


def normalize_address(address: str) -> str:
    """`address` with an IPv6 host put in brackets: "fd00::1:50061" -> "[fd00::1]:50061".

    The part after the last colon is always the port (Kubernetes' `$(POD_IP):port` yields a bare
    IPv6 host on IPv6 clusters). Other addresses come back unchanged. ValueError without a port.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
