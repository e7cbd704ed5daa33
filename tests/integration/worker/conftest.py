"""Fixtures of the worker integration tests (helpers live in harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.worker.harness import RunningWorker, running_worker, worker_settings
from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("worker-models") / "tiny-bpe", "bpe")


@pytest.fixture(scope="session")
def tiny_byte_fallback_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("worker-models") / "tiny-bf", "byte_fallback")


@pytest.fixture
async def prefill(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    """A prefill worker on the tiny model (its default KV transport: NIXL where it loads)."""
    async with running_worker(worker_settings(tiny_model, "prefill")) as w:
        yield w


@pytest.fixture
async def decode(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "decode")) as w:
        yield w
