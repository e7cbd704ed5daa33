"""Settings every test shares: hypothesis runs without its per-example deadline (200 ms by default),
because CI and developer machines are shared and a slow example is not a failure; examples stay
bounded by each test's max_examples. `--failure-log FILE` appends each failed test's report to
FILE the moment it fails (the GPU window's tests run under a time limit that may interrupt
pytest before its summary, which is where tracebacks are printed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--failure-log", default="", help="append each failed test's report to this file as it fails"
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """(Under xdist on the controller only, which every worker's reports reach.)"""
    if not report.failed:
        return
    path = _failure_log
    if path:
        with Path(path).open("a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


_failure_log = ""


def pytest_configure(config: pytest.Config) -> None:
    global _failure_log
    if not hasattr(config, "workerinput"):  # an xdist worker has it: its controller writes
        _failure_log = str(config.getoption("--failure-log") or "")
