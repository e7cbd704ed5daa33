"""The result files that README.md, docs/*.md and benchmarks/results/README.md name exist.

Superseded result files are deleted (git keeps them); a document that still quotes one cites it
as "`<file>` at commit <hash>", which this check leaves alone. Names with `<...>` or `*` are
patterns (what a benchmark writes), not files.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# the first part of every result file's name (benchmarks/results/README.md: <benchmark>-<class>)
BENCHMARKS = (
    "attention-kernel|cuda-attention|cuda-step-profile|engine|goodput|http|linear-kernels|"
    "kv-offload|lora|ngram-proposer|sampling|sched|serving|soak|spec|stack|step-profile|batch"
)
FILE = r"[\w.-]+\.(?:json|png|txt|md)"
# benchmarks/results/<file> anywhere, or a bare result-file name in backticks or a link target
MENTION = re.compile(
    rf"benchmarks/results/(?P<path>{FILE})"
    rf"|[`(](?P<bare>(?:{BENCHMARKS})(?:[-.][\w.-]*)?\.(?:json|png|txt))[`)]"
)
AT_COMMIT = re.compile(r"`? at commit [0-9a-f]{7,}")


def documents() -> list[Path]:
    return [ROOT / "README.md", RESULTS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def missing_results(text: str) -> list[str]:
    """Result files `text` names that benchmarks/results/ lacks (cited-at-commit ones excepted)."""
    missing = []
    for m in MENTION.finditer(text):
        name = m.group("path") or m.group("bare")
        if AT_COMMIT.match(text, m.end()):
            continue  # a superseded file, quoted with the commit that still has it
        if not (RESULTS / name).exists():
            missing.append(name)
    return missing


def test_every_result_file_the_documents_name_exists() -> None:
    found = {str(doc.relative_to(ROOT)): missing_results(doc.read_text()) for doc in documents()}
    assert {doc: names for doc, names in found.items() if names} == {}


def test_the_check_sees_a_missing_file_and_spares_one_cited_at_a_commit() -> None:
    assert missing_results("see `engine-cpu-avx512.json` and benchmarks/results/stack.json") == []
    assert missing_results("(`engine-2026-11-24.json`; old)") == ["engine-2026-11-24.json"]
    assert missing_results("[x](benchmarks/results/gone.png)") == ["gone.png"]
    assert missing_results("`engine-2026-11-24.json` at commit 306217e") == []
    assert missing_results("`benchmarks/results/goodput-cuda-graphs-notes.md` at commit cfd4600") == []
    assert missing_results("writes `engine-<machine class>.json`, `goodput-*-sweeps.json`") == []
