"""Version-skew fixtures: Python stubs of the frozen v1.0 contract, built into a temp dir, and an
old worker process speaking it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "compat" / "v1.0"
OLD_PEER = Path(__file__).with_name("old_peer.py")


@pytest.fixture(scope="session")
def v1_0_stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """grpc_tools.protoc over compat/v1.0 (like scripts/gen_protos.sh; imports stay `pdserve.v1`)."""
    out = tmp_path_factory.mktemp("v1_0_stubs")
    protos = sorted(str(p.relative_to(SNAPSHOT)) for p in (SNAPSHOT / "pdserve" / "v1").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{SNAPSHOT}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ],
        check=True,
        cwd=SNAPSHOT,
    )
    return out


def run_old_peer(stubs: Path, *args: str, stdin: str = "") -> str:
    result = subprocess.run(
        [sys.executable, str(OLD_PEER), args[0], str(stubs), *args[1:]],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def old_worker(v1_0_stubs: Path) -> Iterator[str]:
    """address of a scripted v1.0 worker running in its own process."""
    proc = subprocess.Popen(
        [sys.executable, str(OLD_PEER), "worker", str(v1_0_stubs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"old worker did not start: {line!r}"
        yield f"127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("compat-models") / "tiny", "bpe")
