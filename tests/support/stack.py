"""Runs the real stack (`pdserve up` as a child process) for e2e tests, on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.cluster_auth import TOKEN_HEADER

ROOT = Path(__file__).resolve().parents[2]
# Offsets used by services/up_shape.py (gateway +0, scheduler +1, load-monitor +2, prefill +10,
# decode +20, unified +30, the gateway's HTTP API +40, metrics +50..+80, gateway i > 0 +90+i and
# its metrics +140+i).
_OFFSETS = (0, 1, 2, 10, 20, 30, 40, 50, 51, 52, 60, 70, 80, 91, 92, 141, 142)


@dataclass
class Stack:
    gateway: str
    scheduler: str
    load_monitor: str
    prefill: str | None
    decode: str | None
    unified: str | None
    port_base: int
    log_dir: Path
    output: list[str]
    cluster_token: str = ""  # what internal RPCs (workers, scheduler, load-monitor) must carry
    pid: int = 0  # of `pdserve up` (the supervisor), where this process started it; 0 otherwise

    @property
    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata for an internal RPC, e.g. `stub.GetLoad(req, metadata=stack.internal_metadata)`."""
        return ((TOKEN_HEADER, self.cluster_token),) if self.cluster_token else ()

    @property
    def http_base_url(self) -> str:
        """The gateway's OpenAI-compatible API (the openai client's base_url)."""
        return f"http://127.0.0.1:{self.port_base + 40}/v1"

    @property
    def workers(self) -> list[str]:
        return [a for a in (self.prefill, self.decode, self.unified) if a]

    def metrics_url(self, offset: int) -> str:
        return f"http://127.0.0.1:{self.port_base + 50 + offset}/metrics"

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base() -> int:
    """A base port such that every port the stack uses is free right now."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + max(_OFFSETS) < 65000 and all(_port_free(base + o) for o in _OFFSETS):
            return base
    raise RuntimeError("no free port range found")


def _pump(stream: Iterable[str], lines: queue.Queue[str | None], sink: list[str]) -> None:
    for line in stream:
        sink.append(line.rstrip("\n"))
        lines.put(line)
    lines.put(None)


@contextlib.contextmanager
def running_stack(
    model: str,
    log_dir: Path,
    *,
    unified: bool = False,
    dp_size: int = 1,
    metrics: bool = False,
    worker_args: Sequence[str] = (),
    up_args: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
) -> Iterator[Stack]:
    base = free_port_base()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--model",
        model,
        "--port-base",
        str(base),
        "--log-dir",
        str(log_dir),
        "--torch-threads",
        "1",
        "--dp-size",
        str(dp_size),
        "--ready-timeout-s",
        str(ready_timeout_s),
    ]
    if unified:
        cmd.append("--unified")
    if metrics:
        cmd.append("--metrics")
    cmd += [f"--worker-arg={a}" for a in worker_args]
    cmd += list(up_args)
    # pdserve up would make a random cluster token; the tests choose it so that they can call
    # internal RPCs (pdserve up never prints it).
    token = secrets.token_urlsafe(16)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PDSERVE_CLUSTER_TOKEN": token},
    )
    output: list[str] = []
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines, output), daemon=True).start()
    stack = Stack(
        gateway=f"127.0.0.1:{base}",
        scheduler=f"127.0.0.1:{base + 1}",
        load_monitor=f"127.0.0.1:{base + 2}",
        prefill=None if unified else f"127.0.0.1:{base + 10}",
        decode=None if unified else f"127.0.0.1:{base + 20}",
        unified=f"127.0.0.1:{base + 30}" if unified else None,
        port_base=base,
        log_dir=log_dir,
        output=output,
        cluster_token=token,
        pid=proc.pid,
    )
    try:
        deadline = time.monotonic() + ready_timeout_s + 30
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    "stack did not come up in time:\n" + "\n".join(output) + "\n" + stack.logs()
                ) from None
            if line is None:
                raise RuntimeError(
                    f"pdserve up exited ({proc.wait()}):\n" + "\n".join(output) + "\n" + stack.logs()
                )
            if line.startswith("pdserve is up"):
                break
        yield stack
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running_processes(
    model: str,
    log_dir: Path,
    *,
    up_args: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
) -> Iterator[Stack]:
    """The stack `pdserve up` would start (same flags, ports and arguments), but started by this
    process directly: no supervisor stops everything when one service dies, so chaos tests can
    kill services one by one. Stopped with SIGTERM (SIGKILL after 30 s) at the end."""
    from services import up, up_processes, up_shape

    base = free_port_base()
    args = up._parse(
        [
            "--model",
            model,
            "--port-base",
            str(base),
            "--log-dir",
            str(log_dir),
            "--torch-threads",
            "1",
            *up_args,
        ]
    )
    children = up_shape.children(args, model)
    for child in children:
        up_processes.start(child, str(log_dir))
    try:
        num_workers = sum(args.worker_counts.values())
        problem = up_processes.wait_ready(children, num_workers, ready_timeout_s, threading.Event(), None)
        stack = Stack(
            gateway=f"127.0.0.1:{base}",
            scheduler=f"127.0.0.1:{base + 1}",
            load_monitor=f"127.0.0.1:{base + 2}",
            prefill=f"127.0.0.1:{base + 10}",
            decode=f"127.0.0.1:{base + 20}",
            unified=None,
            port_base=base,
            log_dir=log_dir,
            output=[],
            cluster_token=args.cluster_token,
        )
        if problem is not None:
            raise RuntimeError(f"the stack did not come up: {problem}\n{stack.logs()}")
        yield stack
    finally:
        up_processes.stop_all(children, grace_s=30.0)
