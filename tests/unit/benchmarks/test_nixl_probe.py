"""The NIXL probe that a GPU window runs first (scripts/gpu_checks.sh, part `stack`): on host
memory, both directions move the named blocks and the byte checks tell a transfer that landed
from one that did not (a broken probe would cost a window's minutes)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")

from benchmarks import nixl_probe


def _args(**over: object) -> argparse.Namespace:
    args = dict(
        device="cpu",
        dtype="bfloat16",
        layout="smollm2",
        block_size=16,
        slots=512,
        tokens=128,
        poll_us=1000,
        shapes=["run", "scattered"],
        threads=["main"],
        ops=["READ", "WRITE"],
        repeat=1,
    )
    args.update(over)
    return argparse.Namespace(**args)


def test_read_and_write_move_the_blocks_they_name_and_are_checked() -> None:
    rows = nixl_probe.probe("poll", "worker", _args())
    assert [(r["op"], r["shape"]) for r in rows] == [
        ("READ", "run"),
        ("WRITE", "run"),
        ("READ", "scattered"),
        ("WRITE", "scattered"),
    ]
    assert all(r["bytes_ok"] for r in rows)
    # either order: each direction's descriptors are its own
    back = nixl_probe.probe("poll", "worker", _args(shapes=["scattered"], ops=["WRITE", "READ"]))
    assert [(r["op"], r["bytes_ok"]) for r in back] == [("WRITE", True), ("READ", True)]
    # 8 blocks of 30 layers x K/V x 3 heads x 16 tokens x 64 dims x 2 bytes
    assert {r["mib"] for r in rows} == {round(8 * 30 * 2 * 3 * 16 * 64 * 2 / 2**20, 1)}


def test_a_transfer_that_moved_nothing_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_probe, "_transfer", lambda *a, **k: 1.0)  # reports, moves nothing
    rows = nixl_probe.probe("poll", "worker", _args(shapes=["run"]))
    assert [(r["op"], r["bytes_ok"]) for r in rows] == [("READ", False), ("WRITE", False)]
