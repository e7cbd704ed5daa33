"""bench_batch's summary: medians over the repeats per condition, and the ratios to `alone`."""

from __future__ import annotations

import pytest

from benchmarks.bench_batch import summarize


def test_the_summary_takes_medians_and_ratios_to_the_interactive_baseline() -> None:
    runs = [
        {"condition": "alone", "ttft_p50_s": 0.2, "tpot_p50_s": 0.05},
        {"condition": "alone", "ttft_p50_s": 0.4, "tpot_p50_s": 0.07},
        {"condition": "batch", "ttft_p50_s": 0.6, "tpot_p50_s": 0.09, "batch_requests_per_s": 1.0},
        {"condition": "batch", "ttft_p50_s": 0.3, "tpot_p50_s": 0.09, "batch_requests_per_s": 3.0},
        {
            "condition": "batch_same_priority",
            "ttft_p50_s": 6.0,
            "tpot_p50_s": 0.12,
            "batch_requests_per_s": 2.0,
        },
    ]
    summary = summarize(runs)
    assert summary["alone"] == pytest.approx({"ttft_p50_s": 0.3, "tpot_p50_s": 0.06})
    assert summary["batch"] == pytest.approx(
        {
            "ttft_p50_s": 0.45,
            "tpot_p50_s": 0.09,
            "batch_requests_per_s": 2.0,
            "ttft_p50_vs_alone": 1.5,
            "tpot_p50_vs_alone": 1.5,
        }
    )
    assert summary["batch_same_priority"]["ttft_p50_vs_alone"] == pytest.approx(20.0)
