"""benchmarks/ngram_proposer.py: its baseline scan proposes what the index does (on sequences that
repeat, where both find matches), and a small run writes the record the notes quote."""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks import ngram_proposer as bench
from services.worker.engine.spec.ngram import NgramProposer


def test_the_baseline_scan_and_the_index_agree_on_repetitive_text() -> None:
    rng = random.Random(5)
    phrase = [rng.randrange(6) for _ in range(9)]
    proposer = NgramProposer(2, 4)
    owner = bench._Owner()
    seq: list[int] = []
    found = 0
    for _ in range(80):
        seq.append(rng.choice(phrase))
        want = bench.scan_propose(seq, 5, 2, 4)
        found += bool(want)
        assert proposer.propose(seq, 5, owner=owner) == want
    assert found > 40  # the comparison covered real proposals, not only empty ones


def test_a_small_run_writes_the_record(tmp_path: Path) -> None:
    out = tmp_path / "ngram.json"
    bench.main(["--requests", "2", "--prompt", "50", "--steps", "10", "--vocab", "20", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["proposals_equal"] is True
    assert doc["scan_us_per_proposal"] > 0 and doc["index_us_per_proposal"] > 0
    assert doc["machine"]["cpu_capability"]
