"""The `pdserve` command as a user types it: help for every service, `generate` against the stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.cli import SERVICES
from tests.support.stack import ROOT, Stack

pytestmark = pytest.mark.e2e


def pdserve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_help_lists_commands() -> None:
    out = pdserve("--help")
    assert out.returncode == 0
    for name in ["up", "generate", *SERVICES]:
        assert name in out.stdout


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_service_documents_flags_and_env(service: str) -> None:
    out = pdserve(service, "--help")
    assert out.returncode == 0, out.stderr
    assert "--listen" in out.stdout
    assert "PDSERVE_LISTEN" in out.stdout


def test_unknown_command_fails_clearly() -> None:
    out = pdserve("frobnicate")
    assert out.returncode == 2
    assert "unknown command" in out.stderr


def test_generate_streams_to_the_terminal(disagg_stack: Stack) -> None:
    out = pdserve("generate", "Hello there", "--address", disagg_stack.gateway, "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert "completion_tokens=" in out.stderr
    assert "finish=FINISH_REASON_" in out.stderr


def test_generate_reports_bad_input(disagg_stack: Stack) -> None:
    out = pdserve("generate", "Hello", "--address", disagg_stack.gateway, "--max-tokens", "0")
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr
