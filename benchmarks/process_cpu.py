"""CPU time of the stack's processes, by role, read from /proc (Linux): what each service spends
per delivered token is what bounds TPOT on a host whose accelerator is faster than its CPUs.

`snapshot(root_pid)` walks the children of `pdserve up` (the supervisor) and sums user + system
time (s) per service module (`services.gateway`, `services.worker`, ...); `per_token_us` turns two
snapshots into CPU µs per completion token per role.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cpu_s(pid: int) -> float:
    # fields after the parenthesised command name; utime and stime are fields 14 and 15 (1-based)
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"-m" in argv:
        module = argv[argv.index(b"-m") + 1].decode()
        return module.removeprefix("services.")
    return Path(argv[0].decode()).name


def snapshot(root_pid: int) -> dict[str, float]:
    """CPU seconds so far per role, over `root_pid`'s descendants (not `root_pid` itself). Two
    workers of one role (prefill and decode both run `services.worker`) are told apart by their
    `--role` argument where they have one."""
    out: dict[str, float] = {}
    todo = _children(root_pid)
    while todo:
        pid = todo.pop()
        try:
            role = _role(pid)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--role" in argv:
                role += ":" + argv[argv.index(b"--role") + 1].decode()
            out[role] = out.get(role, 0.0) + _cpu_s(pid)
        except (OSError, ValueError, IndexError):
            continue
        todo += _children(pid)
    return out


def per_token_us(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU µs per completion token per role between two snapshots."""
    if tokens <= 0:
        return {}
    return {r: round((after[r] - before.get(r, 0.0)) / tokens * 1e6, 1) for r in sorted(after)}


def thread_snapshot(root_pid: int, module: str = "services.worker") -> dict[tuple[int, int], float]:
    """CPU seconds so far per (pid, thread id) of `root_pid`'s descendants running `module`."""
    out: dict[tuple[int, int], float] = {}
    todo = _children(root_pid)
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"-m" in argv and argv[argv.index(b"-m") + 1].decode() == module:
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    stat = (task / "stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    out[(pid, int(task.name))] = (int(fields[11]) + int(fields[12])) * _TICK_S
        except (OSError, ValueError, IndexError):
            continue
        todo += _children(pid)
    return out


def threads_per_token_us(
    before: dict[tuple[int, int], float], after: dict[tuple[int, int], float], tokens: int
) -> dict[str, float]:
    """CPU µs per completion token of each process's main thread (its event loop), its busiest
    other thread (a worker's engine step thread) and the rest, summed over the processes."""
    if tokens <= 0:
        return {}
    out = {"main": 0.0, "busiest_other": 0.0, "rest": 0.0}
    for pid in {p for p, _ in after}:
        deltas = {t: after[(p, t)] - before.get((p, t), 0.0) for p, t in after if p == pid}
        out["main"] += deltas.pop(pid, 0.0)
        if deltas:
            busiest = max(deltas, key=lambda t: deltas[t])
            out["busiest_other"] += deltas.pop(busiest)
            out["rest"] += sum(deltas.values())
    return {k: round(v / tokens * 1e6, 1) for k, v in out.items()}
