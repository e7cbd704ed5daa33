"""`pdserve up`: the whole stack on one machine for development.

Starts load-monitor, scheduler, the workers (by default one prefill + one decode worker;
`--prefill-workers N --decode-workers M` for more, `--unified` / `--unified-workers N` for unified
workers instead) and the gateway (`--gateways N`: N gateway processes sharing the HTTP port) as
child processes, waits until every health check is SERVING and the scheduler sees the workers,
prints the gateway's gRPC address and HTTP base URL (OpenAI-compatible, port-base + 40) with
ready-to-paste grpcurl and curl commands, and stops them all (gateways first, workers, scheduler,
load-monitor) on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

# This module is the command (its flags, its output); the stack's shape is up_shape.py, its child
# processes up_processes.py. The docstring above is `pdserve up --help`'s description.
from services import up_processes, up_shape
from services.up_shape import CLUSTER_TOKEN_ENV, HTTP_OFFSET
from shared.cluster_auth import TOKEN_HEADER, check_token
from shared.tls import TlsSettings


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
    p.add_argument(
        "--quantization",
        default="",
        choices=["", "fp8"],
        help="every worker's --quantization: fp8 = the decoder layers' weights in FP8 (half the "
        "bytes of bf16; GPUs of compute capability 9.0+); prefill and decode workers must agree",
    )
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per worker")
    p.add_argument(
        "--gpus",
        default="",
        help="with --device cuda/auto, the GPUs to place workers on (indices, e.g. 0,1,2,3); default "
        "every visible GPU. Each worker's ranks take the next GPUs (prefill workers first); workers "
        "share a GPU, and split its memory, only once every GPU has one",
    )
    p.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes: they share the HTTP port (the kernel spreads connections over them); "
        "gateway i > 0 serves gRPC on port-base+90+i. More than one when many streams in flight need "
        "more than one CPU core of HTTP/SSE work (each gateway admits its own --max-inflight-requests)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help=f"KV block size (tokens), workers and gateway; 0 = {up_shape.CPU_BLOCK_SIZE} on CPU, "
        f"{up_shape.GPU_BLOCK_SIZE} with --device cuda or auto (GPU attention reads 32-token blocks "
        "~1.5x faster at 64 sequences)",
    )
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
        "the gateway's HTTP API +40; gateway i > 0 +90+i",
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
    p.add_argument(
        "--batch-dir",
        default="",
        help="folder of the gateways' Files and Batch APIs (/v1/files, /v1/batches), kept across "
        "restarts; default ~/.cache/pdserve/batches/<HTTP port> (one per stack); 'off' turns them off",
    )
    p.add_argument(
        "--response-dir",
        default="",
        help="folder of the gateways' stored Responses API responses (store, previous_response_id, "
        "background), kept across restarts; default ~/.cache/pdserve/responses/<HTTP port>; 'off': "
        "nothing stored",
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
    a.worker_counts = up_shape.worker_counts(a)
    a.gpus = up_shape.gpu_list(a.gpus, a.device, _visible_gpus)
    if not 1 <= a.gateways <= up_shape.MAX_GATEWAYS:
        raise SystemExit(
            f"pdserve up: --gateways must be between 1 and {up_shape.MAX_GATEWAYS}, got {a.gateways}"
        )
    if a.block_size < 0:
        raise SystemExit(f"pdserve up: --block-size must be >= 1 (0 = by device), got {a.block_size}")
    a.cluster_token_given = bool(a.cluster_token or os.environ.get(CLUSTER_TOKEN_ENV))
    a.cluster_token = cluster_token(a.cluster_token, os.environ)
    return a


def _visible_gpus() -> int:
    """GPUs this process sees (0 without CUDA); torch is imported only for a GPU stack."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cluster_token(given: str, env: Mapping[str, str]) -> str:
    """The stack's cluster token: the one given (flag, then environment), else a fresh random one,
    so that a local stack's internal RPCs are authenticated by default."""
    token = given or env.get(CLUSTER_TOKEN_ENV, "") or secrets.token_urlsafe(32)
    try:
        return check_token(token)
    except ValueError as exc:
        raise SystemExit(f"pdserve up: {exc}") from None


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
    children = up_shape.children(a, model_path)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for child in children:
        up_processes.start(child, a.log_dir)
    num_workers = sum(a.worker_counts.values())
    tls = TlsSettings(
        tls_cert_file=a.tls_cert_file,
        tls_key_file=a.tls_key_file,
        tls_ca_file=a.tls_ca_file,
        tls_server_name=a.tls_server_name,
    ).tls_config()
    problem = up_processes.wait_ready(children, num_workers, a.ready_timeout_s, stop, tls)
    if problem is not None:
        print(f"pdserve up: not ready: {problem}; stopping", file=sys.stderr, flush=True)
        up_processes.stop_all(children)
        raise SystemExit(1)
    gateway = next(c.address for c in children if c.name == "gateway")
    workers = ", ".join(
        f"{c.name} {c.address}" + (f" on GPU {','.join(map(str, c.gpus))}" if c.gpus else "")
        for c in children
        if "worker" in c.name
    )
    more = [c.address for c in children if c.name.startswith("gateway-")]
    if more:  # the other gateways share the HTTP port; each has its own gRPC port
        gateway += f" (and {', '.join(more)})"
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
    up_processes.stop_all(children)
    raise SystemExit(exit_code)
