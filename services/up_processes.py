"""The child processes of a `pdserve up` stack: starting each (its log to a file or this terminal,
killed with `pdserve up` even when that dies by SIGKILL), waiting until every health check is
SERVING and the scheduler sees the workers, and stopping them in order (gateway first, load-monitor
last), each within a grace period."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.up_shape import CLUSTER_TOKEN_ENV, WORKER_MODULES, Child
from shared.cluster_auth import TOKEN_HEADER
from shared.tls import TlsConfig

_UP_PID = os.getpid()


def _die_with_parent() -> None:
    """Children get SIGTERM if `pdserve up` itself dies, even by SIGKILL (Linux prctl
    PR_SET_PDEATHSIG; runs in the child between fork and exec). A parent that died before the
    prctl took effect is caught by the parent-pid check."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != _UP_PID:
        os._exit(1)


def start(child: Child, log_dir: str) -> None:
    cmd = [sys.executable, "-m", child.module, *child.args]
    stderr = None
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        child.log_path = Path(log_dir) / f"{child.name}.log"
        stderr = open(child.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    child.proc = subprocess.Popen(
        cmd,
        stdout=stderr,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        env={**os.environ, **child.env} if child.env else None,
    )


def _dial(address: str, tls: TlsConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def _health(address: str, tls: TlsConfig | None, timeout_s: float = 2.0) -> int:
    with _dial(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s).status)
        except grpc.RpcError:
            return -1


def _scheduler_worker_count(address: str, tls: TlsConfig | None, cluster_token: str = "") -> int:
    from shared.proto import scheduler_pb2, scheduler_pb2_grpc

    metadata = [(TOKEN_HEADER, cluster_token)] if cluster_token else None
    with _dial(address, tls) as channel:
        try:
            state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(
                scheduler_pb2.GetStateRequest(), timeout=2.0, metadata=metadata
            )
        except grpc.RpcError:
            return -1
        return len(state.workers)


def stop_all(children: Sequence[Child], grace_s: float = 30.0) -> None:
    """The gateways first, all at once (each drains its streams), then every worker at once (each
    drains its own requests; stopping them one by one only added their shutdown times up), then
    the scheduler, the load-monitor last. A child still running `grace_s` after its SIGTERM is killed."""
    stages: list[list[Child]] = []

    def kind(child: Child) -> str:  # one stage per kind: every worker module is one kind
        return "worker" if child.module in WORKER_MODULES.values() else child.module

    for child in reversed(children):  # gateways first, load-monitor last
        if stages and kind(stages[-1][0]) == kind(child):
            stages[-1].append(child)
        else:
            stages.append([child])
    for stage in stages:
        running = [c.proc for c in stage if c.proc and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(
    children: Sequence[Child],
    num_workers: int,
    timeout_s: float,
    stop: threading.Event,
    tls: TlsConfig | None,
) -> str | None:
    """None when ready, else why not."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while time.monotonic() < deadline and not stop.is_set():
        for child in children:
            if child.proc and child.proc.poll() is not None:
                where = f" (log: {child.log_path})" if child.log_path else ""
                return f"{child.name} exited with code {child.proc.returncode}{where}"
        pending = [c for c in pending if _health(c.address, tls) != health_pb2.HealthCheckResponse.SERVING]
        if not pending:
            scheduler = next(c for c in children if c.name == "scheduler")
            token = (scheduler.env or {}).get(CLUSTER_TOKEN_ENV, "")  # GetState is internal
            if _scheduler_worker_count(scheduler.address, tls, token) >= num_workers:
                return None
        time.sleep(0.25)
    if stop.is_set():
        return "interrupted"
    return "timed out waiting for: " + ", ".join(c.name for c in pending or children)
