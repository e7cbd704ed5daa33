"""Fixtures that run the real stack as processes (tiny models for speed, SmolLM2 where marked slow)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.stack import Stack, running_stack
from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bpe", "bpe")


@pytest.fixture(scope="module")
def disagg_stack(tiny_bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(str(tiny_bpe_model), tmp_path_factory.mktemp("logs-disagg")) as stack:
        yield stack


@pytest.fixture(scope="module")
def unified_stack(tiny_bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(str(tiny_bpe_model), tmp_path_factory.mktemp("logs-unified"), unified=True) as stack:
        yield stack
