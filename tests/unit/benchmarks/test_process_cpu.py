"""process_cpu reads each descendant's CPU time by service module and turns two snapshots into
µs per token."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import process_cpu


def test_a_busy_grandchild_module_is_counted_under_its_module_name() -> None:
    # a parent (not counted) whose child runs `python -m timeit`, spinning for seconds
    script = (
        "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'timeit', '-n', '1000000000', 'pass'])"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL)
    try:
        before: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while not before.get("timeit") and time.monotonic() < deadline:
            time.sleep(0.05)
            before = process_cpu.mark(parent.pid).roles
        assert list(before) == ["timeit"]
        time.sleep(0.5)
        after = process_cpu.mark(parent.pid).roles
        assert after["timeit"] > before["timeit"]  # it kept spinning between the two snapshots
        per = process_cpu.per_token_us(before, after, tokens=1000)
        assert per["timeit"] == round((after["timeit"] - before["timeit"]) / 1000 * 1e6, 1)
        assert process_cpu.per_token_us(before, after, tokens=0) == {}
    finally:
        parent.kill()
        parent.wait()
