"""`pdserve up`: the whole stack on one machine for development.

Starts load-monitor, scheduler, the workers (by default one prefill + one decode worker;
`--prefill-workers N --decode-workers M` for more, `--unified` / `--unified-workers N` for unified
workers instead) and the gateway as child processes, waits until every health check is SERVING and the
scheduler sees the workers, prints the gateway's gRPC address and HTTP base URL (OpenAI-compatible,
port-base + 40) with ready-to-paste grpcurl and curl commands, and
stops them all (gateway first, workers, scheduler, load-monitor) on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.cluster_auth import TOKEN_HEADER, check_token
from shared.tls import TlsConfig, TlsSettings

PORT_OFFSETS = {
    "gateway": 0,
    "scheduler": 1,
    "load-monitor": 2,
    "prefill-worker": 10,
    "decode-worker": 20,
    "worker": 30,
}
HTTP_OFFSET = 40  # the gateway's OpenAI-compatible HTTP API listens on base + HTTP_OFFSET
METRICS_OFFSET = 50  # metrics port = base + METRICS_OFFSET + offset, when --metrics
MAX_WORKERS_PER_KIND = 10  # worker i of a kind listens on base + offset + i (offsets 10 apart)
CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
WORKER_MODULES = {
    "prefill-worker": "services.prefill_worker",
    "decode-worker": "services.decode_worker",
    "worker": "services.worker",
}


@dataclass
class Child:
    name: str
    module: str
    address: str
    args: list[str]
    env: dict[str, str] | None = None  # added to this process's environment (secrets: not in argv)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__)
    p.add_argument(
        "--unified",
        action="store_true",
        help="unified workers (one unless --unified-workers) instead of prefill + decode",
    )
    p.add_argument("--prefill-workers", type=int, default=1, help="prefill workers (disaggregated serving)")
    p.add_argument("--decode-workers", type=int, default=1, help="decode workers (disaggregated serving)")
    p.add_argument(
        "--unified-workers",
        type=int,
        default=0,
        help="unified workers; > 0 implies --unified (default 1 with it)",
    )
    p.add_argument(
        "--model", default="default", help="model folder, or 'default' (bundled SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--model-cache-dir",
        default="",
        help="where the default model is converted (default ~/.cache/pdserve/models)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per worker")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (tokens), workers and gateway")
    p.add_argument("--tls-cert-file", default="", help="PEM certificate for every service (TLS on when set)")
    p.add_argument("--tls-key-file", default="", help="PEM key for every service")
    p.add_argument("--tls-ca-file", default="", help="PEM CA bundle that certificates are checked against")
    p.add_argument("--tls-server-name", default="", help="name in the certificates, if not the host")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds and advertises")
    p.add_argument(
        "--port-base",
        type=int,
        default=50051,
        help="gateway; scheduler +1, load-monitor +2, worker i: prefill +10+i, decode +20+i, unified +30+i; "
        "the gateway's HTTP API +40",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="API key the gateway requires on every public call (repeatable; passed in its environment)",
    )
    p.add_argument(
        "--cluster-token",
        default="",
        help="token every internal RPC must carry (passed to the services in their environment); "
        f"default: ${CLUSTER_TOKEN_ENV}, else a random one for this run (never printed)",
    )
    p.add_argument("--metrics", action="store_true", help="expose /metrics on port-base+50+offset")
    p.add_argument(
        "--log-dir", default="", help="write each service's log to DIR/<service>.log (default: this terminal)"
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag passed to every worker (repeatable), e.g. --worker-arg=--kv-cache-tokens=4096",
    )
    for kind in ("prefill-worker", "decode-worker", "scheduler", "load-monitor", "gateway"):
        p.add_argument(
            f"--{kind}-arg",
            action="append",
            default=[],
            help=f"extra flag passed to the {kind}{'s' if 'worker' in kind else ''} (repeatable)",
        )
    a = p.parse_args(list(argv))
    a.worker_counts = worker_counts(a)
    a.cluster_token_given = bool(a.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV))
    a.cluster_token = cluster_token(a.cluster_token, os.environ)
    return a


def cluster_token(given: str, env: Mapping[str, str]) -> str:
    """The stack's cluster token: the one given (flag, then environment), else a fresh random one,
    so that a local stack's internal RPCs are authenticated by default."""
    token = given or env.get(CLUSTER_TOKEN_ENV, "") or secrets.token_urlsafe(32)
    try:
        return check_token(token)
    except ValueError as exc:
        raise SystemExit(f"pdserve up: {exc}") from None


def worker_counts(a: argparse.Namespace) -> dict[str, int]:
    """How many workers of each kind (child name prefix -> count); exits with a one-line error
    for a shape the stack cannot serve."""
    if a.unified or a.unified_workers > 0:
        counts = {"worker": max(1, a.unified_workers)}
    else:
        counts = {"prefill-worker": a.prefill_workers, "decode-worker": a.decode_workers}
    for kind, n in counts.items():
        if not 1 <= n <= MAX_WORKERS_PER_KIND:
            raise SystemExit(f"pdserve up: {kind}s must be between 1 and {MAX_WORKERS_PER_KIND}, got {n}")
    return counts


def _graphs_flag(a: argparse.Namespace) -> list[str]:
    """`--no-cuda-graphs` when several worker processes share the GPU. Every worker of `up` runs
    on the same device, and without MPS the GPU time-slices between processes: an eager prefill
    worker's ~1,000 small kernels per step each wait behind the other process's graph replays.
    Measured on an H200 (benchmarks/results/goodput-cuda-graphs-notes.md): disaggregated chat at
    30 req/s met the TTFT SLO for 3.8 % of requests with graphs against 100 % without, while one
    process with graphs did better than without (TTFT p90 1.14 s vs 1.94 s at 20 req/s)."""
    several = sum(a.worker_counts.values()) > 1
    return ["--no-cuda-graphs"] if several and a.device != "cpu" else []


# the share of the GPU's memory all of up's workers use together (each worker's own default)
GPU_MEMORY_UTILIZATION = 0.9


def _memory_flag(a: argparse.Namespace) -> list[str]:
    """`--gpu-memory-utilization` split evenly when several worker processes share the GPU:
    each worker sizes its KV pool from its share of the device (engine/memory.py), so the first
    one to start cannot take the memory the others need. A --worker-arg given later wins."""
    workers = sum(a.worker_counts.values())
    if workers < 2 or a.device == "cpu":
        return []
    share = int(GPU_MEMORY_UTILIZATION / workers * 1000) / 1000  # rounded down: never over 0.9
    return ["--gpu-memory-utilization", f"{share:g}"]


def worker_name(kind: str, index: int) -> str:
    """`decode-worker`, `decode-worker-1`, ...: the first keeps the plain name (and port)."""
    return kind if index == 0 else f"{kind}-{index}"


def _children(a: argparse.Namespace, model_path: str) -> list[Child]:
    def port(name: str) -> int:
        kind, _, index = name.rpartition("-") if name[-1].isdigit() else (name, "", "0")
        return a.port_base + PORT_OFFSETS[kind] + int(index)

    def addr(name: str) -> str:
        return f"{a.host}:{port(name)}"

    tls = [
        *(["--tls-cert-file", a.tls_cert_file, "--tls-key-file", a.tls_key_file] if a.tls_cert_file else []),
        *(["--tls-ca-file", a.tls_ca_file] if a.tls_ca_file else []),
        *(["--tls-server-name", a.tls_server_name] if a.tls_server_name else []),
    ]

    def common(name: str) -> list[str]:
        metrics = port(name) + METRICS_OFFSET if a.metrics else -1
        return ["--listen", addr(name), "--metrics-port", str(metrics), "--log-level", a.log_level, *tls]

    worker_common = [
        "--load-monitor-address",
        addr("load-monitor"),
        "--model",
        model_path,
        "--model-cache-dir",
        a.model_cache_dir,
        "--device",
        a.device,
        "--dtype",
        a.dtype,
        "--dp-size",
        str(a.dp_size),
        "--block-size",
        str(a.block_size),
        "--torch-threads",
        str(a.torch_threads),
        *_graphs_flag(a),
        *_memory_flag(a),
        *a.worker_arg,  # after ours: a --worker-arg=--cuda-graphs wins
    ]
    children = [
        Child(
            "load-monitor",
            "services.load_monitor",
            addr("load-monitor"),
            [*common("load-monitor"), *a.load_monitor_arg],
        ),
        Child(
            "scheduler",
            "services.scheduler",
            addr("scheduler"),
            [*common("scheduler"), "--load-monitor-address", addr("load-monitor"), *a.scheduler_arg],
        ),
    ]
    for kind, count in a.worker_counts.items():
        role = ["--role", "unified"] if kind == "worker" else []
        own = {"prefill-worker": a.prefill_worker_arg, "decode-worker": a.decode_worker_arg}.get(kind, [])
        for index in range(count):
            name = worker_name(kind, index)
            children.append(
                Child(
                    name,
                    WORKER_MODULES[kind],
                    addr(name),
                    [*common(name), *role, "--advertise-address", addr(name), *worker_common, *own],
                )
            )
    children.append(
        Child(
            "gateway",
            "services.gateway",
            addr("gateway"),
            [
                *common("gateway"),
                "--scheduler-address",
                addr("scheduler"),
                "--model",
                model_path,
                "--model-cache-dir",
                a.model_cache_dir,
                "--block-size",
                str(a.block_size),
                "--http-port",
                str(a.port_base + HTTP_OFFSET),
                *a.gateway_arg,
            ],
            env={"PDSERVE_API_KEYS": ",".join(a.api_key)} if a.api_key else None,
        )
    )
    for child in children:  # in the environment, not argv: /proc/<pid>/cmdline is world-readable
        child.env = {**(child.env or {}), CLUSTER_TOKEN_ENV: a.cluster_token}
    return children


_UP_PID = os.getpid()


def _die_with_parent() -> None:
    """Children get SIGTERM if `pdserve up` itself dies, even by SIGKILL (Linux prctl
    PR_SET_PDEATHSIG; runs in the child between fork and exec). A parent that died before the
    prctl took effect is caught by the parent-pid check."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != _UP_PID:
        os._exit(1)


def _start(child: Child, log_dir: str) -> None:
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


def _stop_all(children: Sequence[Child], grace_s: float = 30.0) -> None:
    """Gateway first (it drains the streams), then every worker at once (each drains its own
    requests; stopping them one by one only added their shutdown times up), then the scheduler,
    the load-monitor last. A child still running `grace_s` after its SIGTERM is killed."""
    stages: list[list[Child]] = []
    for child in reversed(children):  # gateway first, load-monitor last
        if "worker" in child.name and stages and "worker" in stages[-1][0].name:
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


def _wait_ready(
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


def grpcurl_command(gateway: str, ca_file: str = "", server_name: str = "", api_key: bool = False) -> str:
    """A ready-to-paste grpcurl line (plaintext, or TLS checked against `ca_file`); with api_key, a
    placeholder authorization header (the key itself is never printed)."""
    exe = shutil.which("grpcurl") or str(Path(sys.prefix) / "bin" / "grpcurl")
    transport = "-plaintext"
    if ca_file:
        transport = f"-cacert {ca_file}" + (f" -servername {server_name}" if server_name else "")
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 64,
            "temperature": 0,
        }
    )
    auth = "-H 'authorization: Bearer <key>' " if api_key else ""
    return f"{exe} {transport} {auth}-d '{body}' {gateway} pdserve.v1.Gateway/Generate"


def curl_command(http_base: str, api_key: bool = False) -> str:
    """A ready-to-paste curl line for the OpenAI-compatible chat endpoint."""
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    auth = "-H 'Authorization: Bearer <key>' " if api_key else ""
    return f"curl -s {http_base}/chat/completions -H 'Content-Type: application/json' {auth}-d '{body}'"


def main(argv: Sequence[str] | None = None) -> None:
    a = _parse(sys.argv[1:] if argv is None else argv)
    from shared.model_store import resolve_model

    print(f"pdserve up: preparing model {a.model!r} ...", flush=True)
    model_path = str(resolve_model(a.model, a.model_cache_dir or None))
    children = _children(a, model_path)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for child in children:
        _start(child, a.log_dir)
    num_workers = sum(a.worker_counts.values())
    tls = TlsSettings(
        tls_cert_file=a.tls_cert_file,
        tls_key_file=a.tls_key_file,
        tls_ca_file=a.tls_ca_file,
        tls_server_name=a.tls_server_name,
    ).tls_config()
    problem = _wait_ready(children, num_workers, a.ready_timeout_s, stop, tls)
    if problem is not None:
        print(f"pdserve up: not ready: {problem}; stopping", file=sys.stderr, flush=True)
        _stop_all(children)
        raise SystemExit(1)
    gateway = children[-1].address
    workers = ", ".join(f"{c.name} {c.address}" for c in children if "worker" in c.name)
    scheme = "https" if tls is not None else "http"
    http_base = f"{scheme}://{a.host}:{a.port_base + HTTP_OFFSET}/v1"
    print(
        f"pdserve is up: gateway {gateway}, HTTP {http_base} (model {Path(model_path).name}; {workers})",
        flush=True,
    )
    ca = a.tls_ca_file if tls is not None else ""
    keyed = bool(a.api_key)
    print("Try:\n  " + grpcurl_command(gateway, ca, a.tls_server_name, keyed), flush=True)
    print("  " + curl_command(http_base, keyed), flush=True)
    token_from = "yours" if a.cluster_token_given else "a random one for this run"
    print(
        f"Internal RPCs (workers, scheduler, load-monitor) need the cluster token ({token_from}) as "
        f"'{TOKEN_HEADER}' metadata; the gateway's public API does not.",
        flush=True,
    )
    print("Ctrl-C stops everything.", flush=True)
    exit_code = 0
    while not stop.is_set():
        dead = [c for c in children if c.proc and c.proc.poll() is not None]
        if dead:
            print(
                f"pdserve up: {dead[0].name} exited with code {dead[0].proc.returncode}"  # type: ignore[union-attr]
                "; stopping",
                file=sys.stderr,
                flush=True,
            )
            exit_code = 1
            break
        stop.wait(0.5)
    print("pdserve up: stopping ...", flush=True)
    _stop_all(children)
    raise SystemExit(exit_code)
