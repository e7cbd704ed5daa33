"""Serving configurations of the goodput benchmark, each a `pdserve up` command line on the same
two cores (two model processes or ranks, one torch thread each), and starting/stopping one:

- disaggregated:    1 prefill + 1 decode worker
- unified_dp2:      1 unified worker with 2 data-parallel ranks
- unified_2workers: 2 unified workers with 1 rank each, every request aggregated (the
                    scheduler's unified split pinned off)
- conditional:      disaggregated, prompts whose uncached part is below the threshold prefill
                    on the decode worker (scheduler `--local-prefill-threshold`);
                    `conditional@N` is the same with threshold N (several in one run tune it)
- conditional_unified: 2 unified workers; prompts whose uncached part reaches the threshold
                    (128, the scheduler's default) prefill on one and decode on the other,
                    shorter ones run aggregated (scheduler `--unified-disaggregate-threshold`);
                    `conditional_unified@N` with threshold N. Roles follow the traffic instead
                    of a fixed P/D split. Results before 2026-11-26 labelled the threshold 256
                    run `conditional_unified`; they are relabelled `conditional_unified@256`.
"""

from __future__ import annotations

import contextlib
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from services.scheduler.policies import UNIFIED_DISAGGREGATE_THRESHOLD

CONFIG_NAMES = ("disaggregated", "unified_dp2", "unified_2workers", "conditional", "conditional_unified")
DEFAULT_LOCAL_PREFILL_THRESHOLD = 256  # tokens; the conditional configuration's threshold
# tokens; conditional_unified's threshold: the scheduler's default, so the bare name measures
# what `pdserve up --unified-workers 2` does (passed explicitly so the printed command says it)
DEFAULT_UNIFIED_THRESHOLD = UNIFIED_DISAGGREGATE_THRESHOLD

_HTTP_URL = re.compile(r"(https?://[^\s,;)]+/v1)\b")


def is_config(name: str) -> bool:
    try:
        config_args(name)
    except ValueError:
        return False
    return True


def config_args(
    name: str,
    local_prefill_threshold: int = DEFAULT_LOCAL_PREFILL_THRESHOLD,
    unified_threshold: int = DEFAULT_UNIFIED_THRESHOLD,
) -> list[str]:
    """The `pdserve up` flags that make configuration `name` (threads included)."""
    base, _, threshold = name.partition("@")
    if base in ("conditional", "conditional_unified") and threshold:
        if not threshold.isdigit():
            raise ValueError(f"{base}@N needs a token count, got {name!r}")
        name = base
        if base == "conditional":
            local_prefill_threshold = int(threshold)
        else:
            unified_threshold = int(threshold)
    disaggregated = ["--prefill-workers", "1", "--decode-workers", "1", "--torch-threads", "1"]
    if name == "disaggregated":
        return disaggregated
    if name == "unified_dp2":
        return ["--unified", "--dp-size", "2", "--torch-threads", "1"]
    if name == "unified_2workers":
        return [
            "--unified-workers",
            "2",
            "--torch-threads",
            "1",
            "--scheduler-arg=--unified-disaggregate-threshold=0",
        ]
    if name == "conditional":
        return [*disaggregated, f"--scheduler-arg=--local-prefill-threshold={local_prefill_threshold}"]
    if name == "conditional_unified":
        return [
            "--unified-workers",
            "2",
            "--torch-threads",
            "1",
            f"--scheduler-arg=--unified-disaggregate-threshold={unified_threshold}",
        ]
    raise ValueError(
        f"unknown configuration {name!r}; known: {', '.join(CONFIG_NAMES)}, "
        "conditional@N, conditional_unified@N"
    )


def up_command(
    name: str,
    *,
    model: str,
    port_base: int,
    device: str = "cpu",
    dtype: str = "float32",
    log_dir: Path | None = None,
    local_prefill_threshold: int = DEFAULT_LOCAL_PREFILL_THRESHOLD,
    unified_threshold: int = DEFAULT_UNIFIED_THRESHOLD,
    cpus: str = "",
    extra: Sequence[str] = (),
) -> list[str]:
    """The full command (`taskset -c CPUS` first when `cpus` is set) that starts configuration
    `name`; printed so a user can re-run it by hand."""
    cmd = [
        *(["taskset", "-c", cpus] if cpus else []),
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--model",
        model,
        "--device",
        device,
        "--dtype",
        dtype,
        "--port-base",
        str(port_base),
        *(["--log-dir", str(log_dir)] if log_dir else []),
        *config_args(name, local_prefill_threshold, unified_threshold),
        *extra,
    ]
    return cmd


def printable(cmd: Sequence[str]) -> str:
    return shlex.join(cmd)


def http_base_url(output_line: str) -> str | None:
    """The HTTP base URL (`http://HOST:PORT/v1`) that `pdserve up` prints when the stack is up."""
    m = _HTTP_URL.search(output_line)
    return m.group(1) if m else None


def _pump(stream: object, lines: queue.Queue[str | None], sink: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sink.append(line.rstrip("\n"))
        lines.put(line)
    lines.put(None)


@contextlib.contextmanager
def running(cmd: Sequence[str], ready_timeout_s: float = 600.0, cwd: Path | None = None) -> Iterator[str]:
    """Runs `cmd` (a `pdserve up` line) until the stack is up; yields its HTTP base URL; stops
    it (SIGINT: gateway first, workers, scheduler, load-monitor) on exit."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines, output), daemon=True).start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        url = None
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError("the stack did not come up in time:\n" + "\n".join(output[-40:])) from None
            if line is None:
                raise RuntimeError(f"pdserve up exited ({proc.wait()}):\n" + "\n".join(output[-40:]))
            url = url or http_base_url(line)
            if line.startswith("pdserve is up"):
                # the base URL is printed on the ready line or just after it
                grace = time.monotonic() + 5
                while url is None and time.monotonic() < grace:
                    with contextlib.suppress(queue.Empty):
                        more = lines.get(timeout=0.5)
                        if more is None:
                            break
                        url = http_base_url(more)
                if url is None:
                    raise RuntimeError(
                        "pdserve up printed no HTTP base URL (http://HOST:PORT/v1); "
                        "is the OpenAI-compatible HTTP API enabled?\n" + "\n".join(output[-20:])
                    )
                break
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
