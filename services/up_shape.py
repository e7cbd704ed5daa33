"""The shape of a `pdserve up` stack: which child processes (load-monitor, scheduler, the workers
of each kind, gateway), the port each listens on (port-base + a fixed offset per service), and the
flags and environment each gets, including where the workers go on a machine's GPUs and the
flags that several workers on one GPU need."""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.worker.engine.gpu_placement import parse_gpu_list
from shared.errors import InvalidArgument

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
GATEWAY_REPLICA_OFFSET = 90  # gateway i > 0 serves gRPC on base + 90 + i (all share the HTTP port)
MAX_GATEWAYS = 9
CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"  # how children get the cluster token (never argv)
# KV block size (tokens) when --block-size is not given. On a GPU, FlexAttention's KV tile is one
# pool block: measured on an H200 (cuda-attention-h200.json, e5dd904), one 8B layer's decode
# attention for 64 sequences x 2,048 tokens took 0.272 ms over 16-token blocks and 0.181 / 0.179
# / 0.179 ms over 32 / 64 / 128; 32 keeps the prefix cache's granularity finest among those.
# CPU kernels read any size; 16 there.
CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 16, 32


def block_size(a: argparse.Namespace) -> int:
    """--block-size, or the default for the device (`auto` counts as a GPU, as for graphs)."""
    if a.block_size:
        return int(a.block_size)
    return CPU_BLOCK_SIZE if a.device == "cpu" else GPU_BLOCK_SIZE


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
    gpus: tuple[int, ...] = ()  # a worker's GPUs (--cuda-devices), when up placed it
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


def gateway_folder(a: argparse.Namespace, given: str, kind: str) -> str:
    """A gateways' folder (--batch-dir, kind "batches"; --response-dir, "responses"): shared by a
    stack's gateways (each sees what another stored, one resumes what another left) and kept
    across its restarts; stacks on other ports get other folders; "off": none."""
    if given == "off":
        return ""
    return given or str(Path.home() / ".cache" / "pdserve" / kind / str(a.port_base + HTTP_OFFSET))


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


def _graphs_flag(a: argparse.Namespace, kind: str) -> list[str]:
    """`--no-cuda-graphs` for prefill workers on a GPU, whose steps are prompt chunks (eager):
    their graphs would only cost memory and start time. Decode and unified workers keep their
    graphs even where several worker processes share the GPU (issue 31 item 3). Measured on an
    H200 with the Llama-3-8B shape (benchmarks/results/serving-disagg-llama-8b-h200.json,
    2026-11-28), `pdserve up` disaggregated on the one GPU: TPOT p50 one request at a time
    4.6 ms with the graphs against 29.1 ms without, 64 at once 964 vs 642 tok/s. Against it,
    on SmolLM2-135M (goodput-cuda-graphs-notes.md at commit cfd4600): without MPS the GPU
    time-slices between processes, and the prefill worker's many small kernels waited behind
    the decode worker's replays (chat at 30 req/s met its TTFT SLO for 3.8 % of requests with
    graphs, 100 % without); `--decode-worker-arg=--no-cuda-graphs` is the choice there."""
    return ["--no-cuda-graphs"] if kind == "prefill-worker" and a.device != "cpu" else []


# the share of a GPU's memory all of up's workers on it use together (each worker's own default)
GPU_MEMORY_UTILIZATION = 0.9


def gpu_list(flag: str, device: str, count_visible: Callable[[], int]) -> tuple[int, ...]:
    """The GPUs up places workers on: --gpus ("0,1"; indices of the visible devices), else every
    visible one (`count_visible`, called only then); none on --device cpu. Exits with one line for
    a list that is not distinct non-negative integers."""
    if device == "cpu":
        return ()
    try:
        gpus = parse_gpu_list(flag, "--gpus")  # the form a worker's --cuda-devices has
    except InvalidArgument as exc:
        raise SystemExit(f"pdserve up: {exc}") from None
    return gpus or tuple(range(count_visible()))


@dataclass(frozen=True)
class Placement:
    """One worker's GPUs and its --gpu-memory-utilization (None: the worker's default, the GPU
    is its own)."""

    gpus: tuple[int, ...]
    utilization: float | None


def place_workers(names: list[str], dp_size: int, gpus: tuple[int, ...]) -> dict[str, Placement]:
    """Workers (in start order: prefill before decode) onto GPUs: worker i's ranks take the next
    dp_size GPUs, round the list, so workers share a GPU only once every GPU has one; a worker
    that shares a GPU with others gets GPU_MEMORY_UTILIZATION split by the most processes on any
    of its GPUs (rounded down, never over it together), so the first to start cannot take the
    memory the others need (each sizes its KV pool from its share: engine/memory.py). No GPUs
    (none visible): every worker on the one default device, the share split between them all."""
    if not gpus:
        share = _share(len(names))
        return {name: Placement((), share) for name in names}
    taken: list[tuple[int, ...]] = []
    for i in range(len(names)):
        mine = [gpus[(i * dp_size + j) % len(gpus)] for j in range(dp_size)]
        taken.append(tuple(dict.fromkeys(mine)))  # a GPU once, in rank order
    users = {g: sum(g in t for t in taken) for g in gpus}
    return {
        name: Placement(t, _share(max(users[g] for g in t))) for name, t in zip(names, taken, strict=True)
    }


def _share(processes: int) -> float | None:
    if processes < 2:
        return None
    return int(GPU_MEMORY_UTILIZATION / processes * 1000) / 1000


def _placement_flags(placement: Placement, placed: bool) -> list[str]:
    """--cuda-devices (when up placed the workers on listed GPUs) and --gpu-memory-utilization
    (when the worker shares a GPU). A --worker-arg given later wins."""
    flags = ["--cuda-devices", ",".join(map(str, placement.gpus))] if placed else []
    if placement.utilization is not None:
        flags += ["--gpu-memory-utilization", f"{placement.utilization:g}"]
    return flags


def replica_name(kind: str, index: int) -> str:
    """`decode-worker`, `decode-worker-1`, ... (`gateway`, `gateway-1`, ...): the first keeps the
    plain name (and port)."""
    return kind if index == 0 else f"{kind}-{index}"


def children(a: argparse.Namespace, model_path: str) -> list[Child]:
    def port(name: str) -> int:
        kind, _, index = name.rpartition("-") if name[-1].isdigit() else (name, "", "0")
        if kind == "gateway" and index != "0":
            return a.port_base + GATEWAY_REPLICA_OFFSET + int(index)
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
        str(block_size(a)),
        "--torch-threads",
        str(a.torch_threads),
        *(["--quantization", a.quantization] if a.quantization else []),
    ]
    stack = [
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
    names = [replica_name(kind, i) for kind, count in a.worker_counts.items() for i in range(count)]
    on_gpu = a.device != "cpu"
    placements = place_workers(names, a.dp_size, a.gpus) if on_gpu else {}
    for kind, count in a.worker_counts.items():
        role = ["--role", "unified"] if kind == "worker" else []
        own = {"prefill-worker": a.prefill_worker_arg, "decode-worker": a.decode_worker_arg}.get(kind, [])
        for index in range(count):
            name = replica_name(kind, index)
            placement = placements.get(name, Placement((), None))
            stack.append(
                Child(
                    name,
                    WORKER_MODULES[kind],
                    addr(name),
                    [
                        *common(name),
                        *role,
                        "--advertise-address",
                        addr(name),
                        *worker_common,
                        *_placement_flags(placement, bool(a.gpus)),
                        *_graphs_flag(a, kind),
                        *a.worker_arg,  # after ours: a --worker-arg=--cuda-graphs wins
                        *own,
                    ],
                    gpus=placement.gpus,
                )
            )
    gateways = a.gateways
    for index in range(gateways):
        name = replica_name("gateway", index)
        stack.append(
            Child(
                name,
                "services.gateway",
                addr(name),
                [
                    *common(name),
                    "--scheduler-address",
                    addr("scheduler"),
                    "--model",
                    model_path,
                    "--model-cache-dir",
                    a.model_cache_dir,
                    "--block-size",
                    str(block_size(a)),
                    "--http-port",
                    str(a.port_base + HTTP_OFFSET),
                    *(["--http-reuse-port"] if gateways > 1 else []),
                    "--batch-dir",
                    gateway_folder(a, a.batch_dir, "batches"),
                    "--response-dir",
                    gateway_folder(a, a.response_dir, "responses"),
                    *a.gateway_arg,
                ],
                env={"PDSERVE_API_KEYS": ",".join(a.api_key)} if a.api_key else None,
            )
        )
    for child in stack:  # in the environment, not argv: /proc/<pid>/cmdline is world-readable
        child.env = {**(child.env or {}), CLUSTER_TOKEN_ENV: a.cluster_token}
    return stack
