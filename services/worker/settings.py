"""Settings of a worker process (prefill, decode or unified role), from flags and PDSERVE_* env."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.engine.gpu_placement import parse_gpu_list
from services.worker.engine.lora import parse_lora_modules
from services.worker.engine.options import EngineOptions
from shared.addresses import normalize_address
from shared.cluster import Role
from shared.errors import InvalidArgument
from shared.settings import field
from shared.tls import TlsSettings

# Per-role defaults (docs/CONTRIBUTING.md "Settings every service has").
DEFAULT_LISTEN = {
    Role.PREFILL: "0.0.0.0:50061",
    Role.DECODE: "0.0.0.0:50071",
    Role.UNIFIED: "0.0.0.0:50081",
}
DEFAULT_METRICS_PORT = {Role.PREFILL: 9103, Role.DECODE: 9104, Role.UNIFIED: 9105}

# Sentinel for "the role's default port" (-1 already means "disabled").
_ROLE_DEFAULT_PORT = -2


@dataclass(frozen=True)
class WorkerSettings(TlsSettings, EngineOptions):
    """pdserve worker: runs a model; prefill, decode or both (unified)."""

    # The engine's options (batch and pool sizes, the model backend's, speculation's) are
    # embedded from engine/options.py: their flags, env vars and defaults are declared there.

    role: Role = field(Role.UNIFIED, "What this worker does: prefill, decode or unified")  # noqa: RUF009 (an enum member is immutable)
    listen: str = field("", "host:port to serve gRPC on; empty = the role's default port")
    metrics_port: int = field(
        _ROLE_DEFAULT_PORT,
        "Prometheus /metrics port; -1 disables, 0 picks a free one, -2 = the role's default",
    )
    log_level: str = field("info", "Log level", choices=("debug", "info", "warning", "error"))
    log_format: str = field("auto", "Log format", choices=("auto", "json", "console"))
    drain_grace_s: float = field(
        30.0, "On SIGTERM, seconds to let in-flight requests finish before aborting them"
    )
    model: str = field("default", "A local model folder, or 'default' (bundled SmolLM2)")
    model_cache_dir: str = field("", "Where the default model is converted; empty = ~/.cache")
    device: str = field(
        "auto", "Where the model runs; auto = cuda if available", choices=("auto", "cpu", "cuda")
    )
    dtype: str = field(
        "auto",
        "Model and KV dtype; auto = float32 on CPU, bfloat16 on CUDA",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    draft_model: str = field(
        "",
        "The draft model of --speculative draft: a local folder or 'default', resolved like "
        "--model; it must share the target's tokenizer",
    )
    load_monitor_address: str = field("", "host:port of the load-monitor; empty = don't register")
    advertise_address: str = field(
        "",
        "host:port others use to reach this worker; empty = the bound address "
        "(set it, e.g. to the pod IP, when peers run on other hosts)",
    )
    worker_id: str = field("", "Stable id of this worker; empty = generated per process")
    heartbeat_interval_s: float = field(0.0, "Heartbeat period (seconds); 0 = the load-monitor's suggestion")
    register_retry_s: float = field(
        2.0, "Seconds between registration attempts while the load-monitor is unreachable"
    )
    load_refresh_s: float = field(1.0, "Seconds between refreshes of the per-rank load gauges")
    kv_chunk_bytes: int = field(1 << 20, "Target size of one KV push message (bytes)")
    kv_push_timeout_s: float = field(60.0, "Deadline of one KV push to a decode worker (seconds)")
    kv_transport: str = field(
        "auto",
        "KV transports offered to peers: auto = NIXL where nixl-cu13 loads (a pair uses it when "
        "both workers offer it) plus the gRPC push; grpc = the gRPC push only",
        choices=("auto", "grpc"),
    )
    kv_load_failure_policy: str = field(
        "recompute",
        "Decode side, when a NIXL READ of a request's KV fails or times out: recompute = prefill "
        "the prompt here (the request goes on); retry-prefill = abort it here, so the gateway "
        "retries the request on other workers",
        choices=("recompute", "retry-prefill"),
    )
    kv_nixl_progress: str = field(
        "loop",
        "Who progresses this worker's NIXL agent, so peers' READs of its KV complete: loop = "
        "its event loop, about every millisecond while a handoff is in flight (no core spent "
        "idle); thread = NIXL's own progress thread, which answers at once but busy-polls about "
        "half a core (on CUDA, NIXL's UCX plugin runs it with no CUDA context: ai-dynamo/nixl "
        "issue 2102 reports segfaults in cuEventQuery from it)",
        choices=("loop", "thread"),
    )
    kv_read_timeout_s: float = field(10.0, "Deadline of one NIXL READ of a request's KV (seconds)")
    kv_cuda_ipc: bool = field(
        True,
        "With NIXL and KV pools on a GPU: share this worker's pools through CUDA IPC, and copy a "
        "peer's blocks device to device where its pool is on this host and opens here (NIXL READ "
        "otherwise; UCX moves VRAM over TCP on hosts without RDMA NICs)",
    )
    log_prompts: bool = field(False, "Log prompt and completion text (off: never logged)")

    def __post_init__(self) -> None:
        # Settings built in code may name the role by its value ("prefill"): keep the member.
        object.__setattr__(self, "role", Role(self.role))
        if not self.listen:
            object.__setattr__(self, "listen", DEFAULT_LISTEN[self.role])
        if self.metrics_port == _ROLE_DEFAULT_PORT:
            object.__setattr__(self, "metrics_port", DEFAULT_METRICS_PORT[self.role])
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if self.advertise_address:  # peers dial it: an IPv6 pod IP needs brackets
            object.__setattr__(self, "advertise_address", normalize_address(self.advertise_address))
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_read_timeout_s <= 0:
            raise ValueError(f"kv_read_timeout_s must be > 0, got {self.kv_read_timeout_s}")
        if self.kv_chunk_bytes < 1:
            raise ValueError(f"kv_chunk_bytes must be >= 1, got {self.kv_chunk_bytes}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # the list's form here; whether each GPU is visible is checked at start, on the device
        try:
            parse_gpu_list(self.cuda_devices, "cuda_devices")
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        # the specs' form (NAME=PATH, names unique); each folder is read when the engine loads
        try:
            parse_lora_modules(self.lora_modules)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError(
                f"need 1 <= spec_ngram_min ({self.spec_ngram_min}) <= spec_ngram_max ({self.spec_ngram_max})"
            )
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model (a folder, or 'default')")
        for name in (
            "cuda_graph_warm_tokens",
            "draft_kv_cache_tokens",
            "kv_cache_tokens",
            "kv_offload_tokens",
            "max_batch_tokens",
            "max_model_len",
            "torch_threads",
            "cpu_kernel_cache_entries",
            "spec_max_batch_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The names of --lora-modules, in order: the adapters this worker serves at start
        (WorkerInfo)."""
        return tuple(parse_lora_modules(self.lora_modules))

    @property
    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as {name: folder}, in order."""
        return parse_lora_modules(self.lora_modules)

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine's LoRA machinery is on: adapters may be loaded while the worker runs
        (--enable-lora, which --lora-modules implies)."""
        return self.enable_lora or bool(self.lora_modules)

    @property
    def service_name(self) -> str:
        """The logging / tracing service name, e.g. "prefill-worker"."""
        return f"{self.role.value}-worker"
