"""CPU time of the stack's processes, by role, read from /proc (Linux): what each service spends
per delivered token is what bounds TPOT on a host whose accelerator is faster than its CPUs.

`mark(root_pid)` walks the descendants of `pdserve up` (the supervisor) once and takes, in CPU
seconds (user + system), each service module's total (`gateway`, `worker:unified`,
`decode_worker`, ...; several processes of one module are summed) and every worker thread's own;
`per_token(before, after, tokens)` turns two marks into CPU µs per completion token: per role,
and the workers' event loops vs their engine step threads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.up_shape import WORKER_MODULES

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_WORKERS = frozenset(WORKER_MODULES.values())


@dataclass(frozen=True)
class Mark:
    roles: dict[str, float]  # CPU seconds so far per role
    threads: dict[tuple[int, int], float]  # CPU seconds so far per (pid, thread id) of the workers


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cpu_s(stat_path: Path) -> float:
    """utime + stime of a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat file (fields 14 and 15,
    1-based, counted after the parenthesised command name)."""
    stat = stat_path.read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _descendants(root_pid: int) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process under `root_pid` (not `root_pid` itself)."""
    todo = _children(root_pid)
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # it exited meanwhile
            continue
        yield pid, argv
        todo += _children(pid)


def _module(argv: list[bytes]) -> str:
    """The `-m` module a process runs, else its program's name (argv always ends in b"")."""
    return argv[argv.index(b"-m") + 1].decode() if b"-m" in argv else Path(argv[0].decode()).name


def mark(root_pid: int) -> Mark:
    """CPU seconds so far under `root_pid`, per role and per worker thread. A unified worker's
    role says so (`worker:unified`, from its `--role`)."""
    roles: dict[str, float] = {}
    threads: dict[tuple[int, int], float] = {}
    for pid, argv in _descendants(root_pid):
        module = _module(argv)
        role = module.removeprefix("services.")
        if b"--role" in argv:
            role += ":" + argv[argv.index(b"--role") + 1].decode()
        try:
            roles[role] = roles.get(role, 0.0) + _cpu_s(Path(f"/proc/{pid}/stat"))
            if module in _WORKERS:
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    threads[(pid, int(task.name))] = _cpu_s(task / "stat")
        except (OSError, ValueError, IndexError):  # it exited meanwhile
            continue
    return Mark(roles, threads)


def per_token_us(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU µs per completion token per role between two marks' `roles`."""
    if tokens <= 0:
        return {}
    return {r: round((after[r] - before.get(r, 0.0)) / tokens * 1e6, 1) for r in sorted(after)}


def threads_per_token_us(
    before: dict[tuple[int, int], float], after: dict[tuple[int, int], float], tokens: int
) -> dict[str, float]:
    """CPU µs per completion token of each worker's main thread (its event loop), its busiest
    other thread (the engine step thread) and the rest, summed over the worker processes."""
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


def per_token(before: Mark, after: Mark, tokens: int) -> dict[str, dict[str, float]]:
    """Both figures between two marks, under the keys a benchmark result records."""
    return {
        "cpu_us_per_token": per_token_us(before.roles, after.roles, tokens),
        "worker_threads_cpu_us_per_token": threads_per_token_us(before.threads, after.threads, tokens),
    }
