"""Settings of a worker process (prefill, decode or unified role), from flags and PDSERVE_* env."""

from __future__ import annotations

from dataclasses import dataclass

from shared.addresses import normalize_address
from shared.cluster import Role
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
class WorkerSettings(TlsSettings):
    """pdserve worker: runs a model; prefill, decode or both (unified)."""

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
    dp_size: int = field(1, "Data-parallel ranks (model replicas) in this process")
    block_size: int = field(16, "Tokens per KV block")
    kv_cache_tokens: int = field(
        0,
        "KV pool size per rank (tokens); 0 = what --gpu-memory-utilization leaves (CUDA), else "
        "from free memory",
    )
    gpu_memory_utilization: float = field(
        0.9,
        "On CUDA, the share of the GPU's memory this worker may use in all (weights, the largest "
        "step measured at start, graphs, KV cache); the KV pool gets the rest. pdserve up splits "
        "it between workers that share a GPU",
    )
    max_batch_tokens: int = field(
        0, "Tokens per forward pass (decode + prefill chunks); 0 = 512 on CPU, 2048 on CUDA"
    )
    max_num_seqs: int = field(64, "Running requests per rank")
    max_model_len: int = field(0, "Longest prompt + generation (tokens); 0 = the model's limit")
    torch_threads: int = field(0, "torch intra-op threads; 0 = torch default")
    cpu_prepack: bool = field(
        True,
        "On CPU, pack linear-layer weights once for oneDNN (faster at every batch size; "
        "--no-cpu-prepack = torch's default matmul)",
    )
    cpu_row_copy: bool = field(
        True,
        "On CPU in fp32, with --cpu-prepack: also keep every linear weight as panels for a "
        "kernel that runs steps of up to 16 rows (decoding up to 16 sequences) near the memory "
        "bandwidth (built once with g++, cached on disk; costs a second copy of the weights in "
        "memory; a prefill worker never keeps it)",
    )
    cpu_attention_kernel: bool = field(
        True,
        "On CPU in fp32: decode attention of all decoding sequences of a layer in one call of a "
        "C++ kernel (built once with g++, cached on disk) instead of one SDPA call per sequence",
    )
    lean_forward: bool = field(
        True,
        "Llama-architecture models: run the layers as one flat loop of kernel calls (same "
        "numbers as transformers' modules, about half the ops per decode step); "
        "--no-lean-forward = transformers' own forward",
    )
    cuda_graphs: bool = field(
        True,
        "On CUDA, replay decode-only steps as CUDA graphs (one per batch and context bucket; "
        "needs the lean forward); ignored on CPU. --no-cuda-graphs when other processes share "
        "this GPU: without MPS their kernels then wait for time slices behind the graphs",
    )
    cuda_kernels: bool = field(
        True,
        "On CUDA, attention reads the paged KV pool in place (FlexAttention) and Llama layers run "
        "fused and torch.compile'd (compiled at start, seconds); --no-cuda-kernels = the "
        "torch-only eager path, which gathers each step's KV",
    )
    cuda_graph_warm_tokens: int = field(
        1024,
        "With --cuda-graphs: capture at start the graphs of every batch size up to --max-num-seqs "
        "and every context up to this many tokens (longer ones, or all with 0, are captured on "
        "first use; a prefill worker uses 0)",
    )
    cpu_kernel_cache_entries: int = field(
        64,
        "On CPU, oneDNN kernels kept per cache (one per input shape, ~0.3 MiB each); bounds the "
        "memory that prompts of many lengths add over time",
    )
    speculative: str = field(
        "off",
        "Speculative decoding: off, ngram (prompt lookup over the prompt and output), or draft "
        "(a smaller model with the same tokenizer proposes: --draft-model)",
        choices=("off", "ngram", "draft"),
    )
    draft_model: str = field(
        "",
        "The draft model of --speculative draft: a local folder or 'default', resolved like "
        "--model; it must share the target's tokenizer",
    )
    draft_kv_cache_tokens: int = field(
        0, "The draft model's KV pool per rank (tokens); 0 = as many tokens as the target's pool"
    )
    num_speculative_tokens: int = field(5, "Tokens proposed per sequence per step (k)")
    spec_ngram_min: int = field(2, "Shortest suffix n-gram looked up by ngram speculation (tokens)")
    spec_ngram_max: int = field(4, "Longest suffix n-gram looked up by ngram speculation (tokens)")
    spec_max_batch_tokens: int = field(
        0,
        "Proposals are verified only while a step has at most this many tokens (the per-step "
        "back-off); 0 = 32 on CPU, 512 on CUDA",
    )
    spec_step_cost: bool = field(
        True,
        "Learn the step time per token (at start-up, then online) and verify only the proposals "
        "whose expected acceptance pays for their verification; off = every proposal up to "
        "--spec-max-batch-tokens",
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
    kv_read_timeout_s: float = field(10.0, "Deadline of one NIXL READ of a request's KV (seconds)")
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
            "max_batch_tokens",
            "max_model_len",
            "torch_threads",
            "cpu_kernel_cache_entries",
            "spec_max_batch_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def service_name(self) -> str:
        """The logging / tracing service name, e.g. "prefill-worker"."""
        return f"{self.role.value}-worker"
