"""benchmarks/kv_offload.py on a tiny model: each way serves the revisited prompt from where it
says (the pool, the host tier, nothing cached), and the result records the machine and ratios."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import kv_offload
from tests.support.tiny_models import build_tiny_model


def test_each_way_serves_the_revisited_prompt_from_where_it_says(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    out = tmp_path / "offload.json"
    kv_offload.main(
        [
            "--model",
            str(model),
            "--prompt-tokens",
            "48",
            "--block-size",
            "4",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    rows = {r["way"]: r for r in doc["results"]}
    full = (48 - 1) // 4 * 4  # every full block but the one holding the prompt's last token
    assert rows["pool"]["cached_tokens"] == rows["host"]["cached_tokens"] == full
    assert rows["recompute"]["cached_tokens"] < full
    assert rows["host"]["offload_stats"][1] > 0 and rows["pool"]["offload_stats"] is None
    assert set(doc["ratios"]) == {"host_over_recompute", "host_over_pool_hit"}
    assert doc["machine"]["class"].startswith("cpu-") and doc["workload"]["prompt_tokens"] == 48
