"""A throwaway CA and one service certificate (SAN pdserve.internal + 127.0.0.1), made by openssl."""

from __future__ import annotations

import subprocess
from pathlib import Path

SERVER_NAME = "pdserve.internal"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """Writes ca.crt, tls.crt and tls.key into `d` (the layout of a kubernetes.io/tls secret)."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=pdserve-test-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.crt"),
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={SERVER_NAME}",
        "-keyout",
        str(d / "tls.key"),
        "-out",
        str(d / "tls.csr"),
    )
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(d / "tls.csr"),
        "-CA",
        str(d / "ca.crt"),
        "-CAkey",
        str(d / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(d / "ext.cnf"),
        "-out",
        str(d / "tls.crt"),
    )
    return d
