"""Merging goodput result documents: runs of one workload at a time (or of extra
configurations such as `conditional@N` measured later under the same SLOs) become the one
`goodput-<machine class>.json` that the README and the main plot come from.

Rules (a merge never mixes figures measured under different SLOs or on different CPUs):
- a workload's SLO comes from the first document that has the workload; a later document with
  the same workload must carry the same TTFT and TPOT SLO (it was run with `--slo-ttft-ms` /
  `--slo-tpot-ms` copied from the first), else the merge is refused;
- a (workload, configuration) pair measured in several documents (a refinement run at chosen
  `--rates` under the same SLOs) keeps every measured rate, and its goodput is recomputed from
  all of them (`stats.goodput`: the highest passing rate below every failing one);
- except for the pairs named in `replace` (`config` for every workload, or `workload:config`):
  a later document that measured one replaces the earlier documents' rates (and ITL sample and
  command) for it, because the code it ran changed in between in a way that matters for that
  workload (e.g. a scheduler fix); the merged document lists them in `replaced_with_later`;
- every document must come from a machine with the same CPU model and capability;
- the sources (file, note, wall time, load average at start) are listed in `sources`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.goodput import stats


class MergeError(ValueError):
    """Documents that cannot be merged without losing what their figures mean."""


# SLOs (ms) count as the same when they agree to the 0.1 ms the benchmark prints them with: a
# refinement run started with the printed SLOs (161.8) must join the run that derived 161.81.
_SLO_TOLERANCE_MS = 0.05


def _same_slo(a: float, b: float) -> bool:
    return abs(a - b) <= _SLO_TOLERANCE_MS + 1e-9


def merge_docs(
    docs: Sequence[tuple[str, dict[str, Any]]], note: str = "", replace: Sequence[str] = ()
) -> dict[str, Any]:
    """One result document from `docs` ((source name, document) pairs, in order); the pairs in
    `replace` ("config" or "workload:config") keep only their latest document's rates."""
    if not docs:
        raise MergeError("nothing to merge")
    first = docs[0][1]
    out: dict[str, Any] = {
        "note": note,
        "machine": first["machine"],
        "settings": first["settings"],
        "workloads": {},
        "commands": {},
        "slo": {},
        "runs": {},
        "goodput_rps": {},
        "goodput_lower_bound_only": {},
        "itl_samples": {},
        "sources": [],
        "replaced_with_later": sorted(replace),
        "total_wall_s": 0.0,
    }
    target = first["settings"]["attainment_target"]
    for source, doc in docs:
        _same_machine(first["machine"], doc["machine"], source)
        if doc["settings"]["attainment_target"] != target:
            raise MergeError(
                f"{source}: attainment target {doc['settings']['attainment_target']} != {target}"
            )
        for w, slo in doc["slo"].items():
            have = out["slo"].get(w)
            if have is None:
                out["slo"][w] = slo
                out["workloads"][w] = doc["workloads"][w]
            elif not (
                _same_slo(have["ttft_ms"], slo["ttft_ms"]) and _same_slo(have["tpot_ms"], slo["tpot_ms"])
            ):
                raise MergeError(
                    f"{source}: {w} was measured under SLOs TTFT {slo['ttft_ms']} ms / TPOT "
                    f"{slo['tpot_ms']} ms, the earlier document under {have['ttft_ms']} / "
                    f"{have['tpot_ms']} ms; re-run it with --slo-ttft-ms {have['ttft_ms']} "
                    f"--slo-tpot-ms {have['tpot_ms']}"
                )
        for w, by_config in doc.get("runs", {}).items():
            into = out["runs"].setdefault(w, {})
            for config, points in by_config.items():
                if config in replace or f"{w}:{config}" in replace:
                    into[config] = []
                    out["itl_samples"].get(w, {}).get("by_config", {}).pop(config, None)
                into.setdefault(config, []).extend(points)
        for w, sample in doc.get("itl_samples", {}).items():
            _merge_itl(out["itl_samples"], w, sample)
        for config, cmd in doc.get("commands", {}).items():
            if config in replace or any(r.endswith(f":{config}") for r in replace):
                out["commands"][config] = cmd  # the command of the code that replaced it
            out["commands"].setdefault(config, cmd)
        out["sources"].append(
            {
                "file": source,
                "note": doc.get("note", ""),
                "workloads": sorted(doc["slo"]),
                "configs": sorted({c for row in doc.get("goodput_rps", {}).values() for c in row}),
                "total_wall_s": doc.get("total_wall_s"),
                "load_average_1m_at_start": doc["machine"].get("load_average_1m_at_start"),
            }
        )
        out["total_wall_s"] = round(out["total_wall_s"] + float(doc.get("total_wall_s") or 0.0), 1)
    for w, by_config in out["runs"].items():
        for config, points in by_config.items():
            if not points:
                continue
            pairs = [(float(p["rate_rps"]), float(p["attainment"])) for p in points]
            out["goodput_rps"].setdefault(w, {})[config] = stats.goodput(pairs, target)
            out["goodput_lower_bound_only"].setdefault(w, {})[config] = all(a >= target for _, a in pairs)
    return out


def _same_machine(a: dict[str, Any], b: dict[str, Any], source: str) -> None:
    for key in ("cpu_model", "cpu_capability", "cpu_count", "torch"):
        if a.get(key) != b.get(key):
            raise MergeError(
                f"{source}: measured on another machine ({key} {b.get(key)!r} != {a.get(key)!r})"
            )
    if a.get("cuda_device") != b.get("cuda_device"):
        raise MergeError(f"{source}: measured on another device ({b.get('cuda_device')!r})")


def _merge_itl(into: dict[str, Any], workload: str, sample: dict[str, Any]) -> None:
    """ITL samples are kept at one rate per workload: the first document's rate; a later
    document adds the configurations it measured at that same rate."""
    have = into.get(workload)
    if have is None:
        into[workload] = {"rate_rps": sample["rate_rps"], "by_config": dict(sample["by_config"])}
    elif have["rate_rps"] == sample["rate_rps"]:
        for config, itls in sample["by_config"].items():
            have["by_config"].setdefault(config, itls)
