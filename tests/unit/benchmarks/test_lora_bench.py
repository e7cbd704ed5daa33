"""benchmarks/lora.py on a tiny model: the random adapters it writes load as PEFT folders of the
model's shapes, every way is timed, and the result records the machine and the ratios."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import lora
from tests.support.tiny_models import build_tiny_model


def test_every_way_is_timed_through_adapters_of_the_models_shapes(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    out = tmp_path / "lora.json"
    lora.main(
        [
            "--model",
            str(model),
            "--adapters",
            "2",
            "--rank",
            "4",
            "--batch",
            "3",
            "--decode-prompt",
            "12",
            "--new-tokens",
            "4",
            "--prompt-tokens",
            "24",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    rows = doc["results"]
    for way in ("base", "one", "mixed"):
        assert rows[way]["tpot_ms"] > 0 and len(rows[way]["tpot_ms_runs"]) == 1
    assert rows["prefill_base"]["ttft_ms"] > 0 and rows["prefill_adapter"]["ttft_ms"] > 0
    assert set(doc["ratios"]) == {
        "one_adapter_tpot_over_base",
        "mixed_tpot_over_base",
        "adapter_ttft_over_base",
    }
    assert doc["machine"]["class"].startswith("cpu-") and doc["workload"]["adapters"] == 2
