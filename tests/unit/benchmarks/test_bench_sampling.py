"""benchmarks/bench_sampling.py on a tiny model: every variant runs and gets a step time and a
ratio to plain; the sampler-alone timings cover the same variants."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_sampling
from tests.support.tiny_models import build_tiny_model


def test_bench_sampling_runs_every_variant(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", "bpe")
    out = tmp_path / "sampling.json"
    bench_sampling.main(
        [
            "--model",
            str(model),
            "--rounds",
            "1",
            "--num-requests",
            "2",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "5",
            "--sampler-calls",
            "3",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert set(result["decode_step_ms"]) == set(bench_sampling.VARIANTS)
    assert result["ratio_vs_plain"]["plain"] == 1.0
    assert set(result["sampler_alone_ms"]) == set(bench_sampling.VARIANTS) - {"json_schema_half"}
