"""Fixtures of the worker integration tests (helpers live in harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("worker-models") / "tiny-bpe", "bpe")


@pytest.fixture(scope="session")
def tiny_byte_fallback_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("worker-models") / "tiny-bf", "byte_fallback")
