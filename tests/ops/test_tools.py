"""The operations tools `make tools` installs from package registries: pinned versions, and a
second run installs nothing (so `make test` stays fast when they are present)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"
SCRIPT = ROOT / "scripts" / "ops_install_tools.sh"
BUF = TOOLS / "node_modules" / ".bin" / "buf"
HELM = TOOLS / "bin" / "helm"
EXAMPLE = ROOT / "examples" / "node"

pytestmark = pytest.mark.skipif(
    not (BUF.exists() and HELM.exists()), reason="tools are not installed here: run `make tools`"
)


def pinned(name: str) -> str:
    """A version pinned in the install script, e.g. BUF_VERSION=${BUF_VERSION:-1.75.0}."""
    m = re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}", SCRIPT.read_text(), re.MULTILINE)
    assert m, name
    return m.group(1)


def run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_pinned_versions_are_installed() -> None:
    assert run(str(BUF), "--version") == pinned("BUF_VERSION")
    assert run(str(HELM), "version", "--template", "{{.Version}}").startswith(pinned("HELM_VERSION_PREFIX"))
    assert shutil.which("protoc") is not None
    assert run("protoc", "--version").startswith("libprotoc ")


def test_node_example_deps_match_the_lock_file() -> None:
    lock = json.loads((EXAMPLE / "package-lock.json").read_text())
    declared = json.loads((EXAMPLE / "package.json").read_text())["dependencies"]
    for name, version in declared.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"{name} must be pinned exactly"
        assert lock["packages"][f"node_modules/{name}"]["version"] == version
        installed = EXAMPLE / "node_modules" / name / "package.json"
        if installed.exists():
            assert json.loads(installed.read_text())["version"] == version


def test_second_run_installs_nothing() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "TOOLS": str(TOOLS)}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert "installing" not in proc.stdout, proc.stdout
