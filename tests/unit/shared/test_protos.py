"""The generated stubs match protos/ (CI fails on stale stubs), and the v1.x evolution rules hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shared.proto import common_pb2, gateway_pb2, worker_pb2

ROOT = Path(__file__).resolve().parents[3]


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    out = tmp_path / "shared" / "gen"
    subprocess.run(
        ["bash", "scripts/gen_protos.sh", str(out)],
        cwd=ROOT,
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    for fresh in sorted(out.rglob("*.py*")):
        rel = fresh.relative_to(out)
        have = ROOT / "shared" / "gen" / rel
        assert have.exists(), f"shared/gen/{rel} missing: run make gen"
        assert have.read_text() == fresh.read_text(), f"shared/gen/{rel} is stale: run make gen"


def test_generated_tokens_fields_have_presence() -> None:
    for msg in (worker_pb2.PrefillResponse(), worker_pb2.DecodeFrame(), worker_pb2.KvChunk()):
        assert not msg.HasField("generated_tokens")
        msg.generated_tokens = 0
        assert msg.HasField("generated_tokens"), "0 must be distinguishable from unset"


def test_every_field_is_commented() -> None:
    """Every field and enum value has a comment line right above it (units live there)."""
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if (
                s.endswith(";")
                and "=" in s
                and not s.startswith(("option", "//", "syntax", "package", "reserved"))
            ):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} uncommented: {s}"


def test_finish_reasons_and_frame_kinds() -> None:
    assert common_pb2.FinishReason.Name(common_pb2.FINISH_REASON_LENGTH) == "FINISH_REASON_LENGTH"
    assert gateway_pb2.FrameKind.Name(gateway_pb2.FRAME_KIND_FINAL) == "FRAME_KIND_FINAL"
