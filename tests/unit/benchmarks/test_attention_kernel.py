"""benchmarks/attention_kernel.py on a small step: every contender computes SDPA's attention for
every block layout, and the record has what the kernel's docstring quotes."""

from __future__ import annotations

from benchmarks import attention_kernel as ak


def test_contenders_agree_on_every_layout() -> None:
    from services.worker.engine import cpu_kernels

    out = ak.measure(seqs=3, context=37, layers=2, reps=1)
    assert set(out["layouts"]) == set(ak.LAYOUTS)
    assert out["kv_mb"] == round(2 * 2 * 3 * 3 * 37 * 64 * 4 / 1e6, 1)
    names = {"sdpa_per_sequence"}
    if cpu_kernels.available():
        names |= {"kernel_avx2"} | ({"kernel_avx512"} if cpu_kernels.has_avx512() else set())
    for row in out["layouts"].values():
        assert set(row) == names
        for m in row.values():
            assert m["ms"] > 0 and m["gb_s"] > 0
            assert m["max_abs_diff"] < 1e-5


def test_tables_give_each_sequence_its_blocks() -> None:
    consecutive = ak._tables("consecutive", 2, 3, 6).tolist()
    assert consecutive == [[0, 1, 2], [3, 4, 5]]
    shuffled = ak._tables("shuffled", 2, 3, 6)
    assert sorted(shuffled.flatten().tolist()) == list(range(6)) and shuffled.tolist() != consecutive
    assert ak._tables("cached", 2, 3, 6).tolist() == [[0, 1, 2], [0, 1, 2]]
