"""Merging goodput result documents (benchmarks/goodput/merge.py): one workload per run, or extra
configurations or refinement rates measured later under the same SLOs, become one document;
figures measured under other SLOs or on another machine are refused."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.goodput.merge import MergeError, merge_docs

MACHINE = {"cpu_model": "AMD EPYC", "cpu_capability": "AVX512", "cpu_count": 2, "torch": "2.13.0+cpu"}


def doc(
    workload: str, configs: dict[str, float], slo: tuple[float, float] = (3000.0, 80.0)
) -> dict[str, Any]:
    return {
        "note": f"{workload} run",
        "machine": dict(MACHINE, load_average_1m_at_start=0.1),
        "settings": {"attainment_target": 0.9},
        "workloads": {workload: {"name": workload}},
        "commands": {c: f"pdserve up {c}" for c in configs},
        "slo": {workload: {"ttft_ms": slo[0], "tpot_ms": slo[1], "derivation": []}},
        "runs": {workload: {c: [{"rate_rps": gp, "attainment": 0.95}] for c, gp in configs.items()}},
        "goodput_rps": {workload: dict(configs)},
        "goodput_lower_bound_only": {workload: {c: False for c in configs}},
        "itl_samples": {workload: {"rate_rps": 0.5, "by_config": {c: [25.0, 26.0] for c in configs}}},
        "total_wall_s": 100.0,
    }


def test_workloads_and_later_configurations_merge_under_the_same_slos() -> None:
    chat = doc("chat", {"disaggregated": 0.65, "unified_dp2": 0.46})
    lp = doc("long_prompt", {"disaggregated": 0.23}, slo=(9000.0, 90.0))
    tuning = doc("chat", {"conditional@128": 0.7})
    merged = merge_docs([("chat.json", chat), ("lp.json", lp), ("tune.json", tuning)], note="all")
    assert merged["goodput_rps"] == {
        "chat": {"disaggregated": 0.65, "unified_dp2": 0.46, "conditional@128": 0.7},
        "long_prompt": {"disaggregated": 0.23},
    }
    assert merged["slo"]["long_prompt"]["ttft_ms"] == 9000.0
    assert set(merged["runs"]["chat"]) == {"disaggregated", "unified_dp2", "conditional@128"}
    assert set(merged["itl_samples"]["chat"]["by_config"]) == {
        "disaggregated",
        "unified_dp2",
        "conditional@128",
    }
    assert [s["file"] for s in merged["sources"]] == ["chat.json", "lp.json", "tune.json"]
    assert merged["total_wall_s"] == 300.0
    assert merged["note"] == "all"


def test_a_workload_measured_under_other_slos_is_refused_with_the_flags_to_rerun() -> None:
    with pytest.raises(MergeError, match=re.escape("--slo-ttft-ms 3000.0 --slo-tpot-ms 80.0")):
        merge_docs(
            [("a", doc("chat", {"disaggregated": 0.6})), ("b", doc("chat", {"x": 1.0}, slo=(2000.0, 80.0)))]
        )


def test_slos_that_agree_to_the_printed_tenth_of_a_ms_are_the_same() -> None:
    """The benchmark prints SLOs to 0.1 ms; a run started with the printed 80.0 joins one that
    derived 80.04, one at 80.1 does not."""
    derived = doc("chat", {"disaggregated": 0.6}, slo=(3000.0, 80.04))
    printed = doc("chat", {"unified_dp2": 0.5}, slo=(3000.0, 80.0))
    merged = merge_docs([("a", derived), ("b", printed)])
    assert merged["slo"]["chat"]["tpot_ms"] == 80.04  # the first document's SLOs are kept
    assert set(merged["goodput_rps"]["chat"]) == {"disaggregated", "unified_dp2"}
    with pytest.raises(MergeError, match="SLOs"):
        merge_docs([("a", derived), ("c", doc("chat", {"x": 1.0}, slo=(3000.0, 80.1)))])


def test_a_refinement_run_adds_rates_and_the_goodput_is_recomputed_from_all() -> None:
    first = doc("chat", {"disaggregated": 0.46})
    first["runs"]["chat"]["disaggregated"] = [
        {"rate_rps": 0.46, "attainment": 1.0},
        {"rate_rps": 0.92, "attainment": 0.7},
    ]
    refine = doc("chat", {"disaggregated": 0.0})
    refine["runs"]["chat"]["disaggregated"] = [
        {"rate_rps": 0.6, "attainment": 0.95},
        {"rate_rps": 0.75, "attainment": 0.8},
        {"rate_rps": 0.85, "attainment": 0.95},  # a lucky pass above a failure does not count
    ]
    merged = merge_docs([("a", first), ("refine", refine)])
    assert [p["rate_rps"] for p in merged["runs"]["chat"]["disaggregated"]] == [0.46, 0.92, 0.6, 0.75, 0.85]
    assert merged["goodput_rps"]["chat"]["disaggregated"] == 0.6
    assert merged["goodput_lower_bound_only"]["chat"]["disaggregated"] is False


def test_another_machine_is_refused() -> None:
    other = doc("long_prompt", {"disaggregated": 0.2})
    other["machine"]["cpu_capability"] = "AVX2"
    with pytest.raises(MergeError, match="another machine"):
        merge_docs([("a", doc("chat", {"disaggregated": 0.6})), ("b", other)])


def test_merge_files_writes_the_document_its_checks_and_plots(tmp_path: Path) -> None:
    from benchmarks import bench_goodput

    files = []
    for i, d in enumerate(
        [doc("chat", {"disaggregated": 0.75, "unified_dp2": 0.5}), doc("chat", {"conditional@256": 0.75})]
    ):
        files.append(tmp_path / f"in{i}.json")
        files[-1].write_text(json.dumps(d))
    out = tmp_path / "goodput.json"
    before = [copy.deepcopy(json.loads(f.read_text())) for f in files]
    result = bench_goodput.main(["--merge", *map(str, files), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["goodput_rps"] == result["goodput_rps"]
    assert "chat: disaggregated / best unified = 1.50x (target >= 1.5x on chat)" in saved["checks"]
    assert "chat: conditional@256 >= the best other configuration (0.75 vs 0.75)" in saved["checks"]
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert [json.loads(f.read_text()) for f in files] == before  # inputs untouched


def test_configurations_named_to_replace_keep_only_the_later_run() -> None:
    """A configuration re-measured after a code change (a scheduler fix) must not pool its new
    passing rates with the old code's failing ones; other configurations still pool."""
    old = doc("long_output", {"disaggregated": 0.48, "unified_2workers": 0.48})
    old["runs"]["long_output"]["unified_2workers"].append({"rate_rps": 0.68, "attainment": 0.26})
    old["runs"]["long_output"]["disaggregated"].append({"rate_rps": 0.68, "attainment": 0.45})
    new = doc("long_output", {"unified_2workers": 1.36})
    new["runs"]["long_output"]["unified_2workers"].insert(0, {"rate_rps": 0.96, "attainment": 1.0})
    new["itl_samples"]["long_output"]["rate_rps"] = 0.96
    new["commands"]["unified_2workers"] = "pdserve up --fixed"
    pooled = merge_docs([("old.json", old), ("new.json", new)])
    assert pooled["goodput_rps"]["long_output"]["unified_2workers"] == 0.48  # old failure caps it
    merged = merge_docs([("old.json", old), ("new.json", new)], replace=["unified_2workers"])
    assert merged["goodput_rps"]["long_output"] == {"disaggregated": 0.48, "unified_2workers": 1.36}
    assert [p["rate_rps"] for p in merged["runs"]["long_output"]["unified_2workers"]] == [0.96, 1.36]
    assert merged["commands"]["unified_2workers"] == "pdserve up --fixed"
    # the old code's ITL sample is gone (the new run sampled another rate)
    assert "unified_2workers" not in merged["itl_samples"]["long_output"]["by_config"]
    assert merged["replaced_with_later"] == ["unified_2workers"]
    # workload-qualified: only that workload's pair is replaced
    sp_old = doc("shared_prefix", {"unified_2workers": 0.38}, slo=(5000.0, 180.0))
    sp_new = doc("shared_prefix", {"unified_2workers": 0.48}, slo=(5000.0, 180.0))
    sp_new["runs"]["shared_prefix"]["unified_2workers"][0]["attainment"] = 0.27
    qualified = merge_docs(
        [("old.json", old), ("sp_old.json", sp_old), ("new.json", new), ("sp_new.json", sp_new)],
        replace=["long_output:unified_2workers"],
    )
    assert qualified["goodput_rps"]["long_output"]["unified_2workers"] == 1.36
    assert qualified["goodput_rps"]["shared_prefix"]["unified_2workers"] == 0.38  # pooled
