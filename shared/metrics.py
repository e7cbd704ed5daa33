"""Every Prometheus metric pdserve exports (namespace `pdserve_`), defined once, plus the endpoint.

Services import the objects they update; each process only exports what it touched. Units are in
the names (`_seconds`, `_tokens`, `_bytes`). Label values are bounded (dp_rank, policy, code).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from shared.server import PortInUse

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SMALL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# --- gateway: request lifecycle (computed once, when a request finishes) ---
TTFT_SECONDS = Histogram(
    "pdserve_time_to_first_token_seconds", "Request arrival to first token sent", buckets=_LATENCY_BUCKETS_S
)
TTFT_PHASE_SECONDS = Histogram(
    "pdserve_time_to_first_token_phase_seconds",
    "Where the time to first token went: schedule (arrival until its workers were chosen), admit "
    "(the decode worker's admission, disaggregated), prefill (the prompt and, disaggregated, the "
    "KV handoff, until the first token was sent)",
    ["phase"],
    buckets=_LATENCY_BUCKETS_S,
)
INTER_TOKEN_SECONDS = Histogram(
    "pdserve_inter_token_latency_seconds", "Time between streamed frames", buckets=_SMALL_BUCKETS_S
)
E2E_SECONDS = Histogram(
    "pdserve_e2e_request_latency_seconds", "Request arrival to final frame", buckets=_LATENCY_BUCKETS_S
)
QUEUE_SECONDS = Histogram(
    "pdserve_queue_time_seconds", "Arrival to first scheduled by the engine", buckets=_LATENCY_BUCKETS_S
)
# by `model`: the model id the request named (the served model, or a LoRA adapter's name): usage
# per adapter for a cluster serving several (a bounded set: only listed models get this far)
PROMPT_TOKENS = Counter("pdserve_prompt_tokens_total", "Prompt tokens of finished requests", ["model"])
GENERATION_TOKENS = Counter(
    "pdserve_generation_tokens_total", "Generated tokens (sum of usage.completion_tokens)", ["model"]
)
REQUESTS = Counter("pdserve_requests_total", "Finished requests", ["finish_reason", "model"])
ERRORS = Counter("pdserve_errors_total", "RPCs that ended with an error status", ["code"])
# The Batch API (gateway): a batch's requests as written to its output file (outcome completed)
# or error file (failed: answered non-2xx; expired: not run within the window), batches by how
# they ended, and the batches this gateway runs now
BATCH_REQUESTS = Counter("pdserve_batch_requests_total", "Requests of batches, by outcome", ["outcome"])
BATCHES = Counter("pdserve_batches_total", "Batches that ended, by final status", ["status"])
BATCHES_RUNNING = Gauge("pdserve_batches_running", "Batches this gateway process is running")
# Stored Responses API responses (gateway, --response-dir): by the status they ended with, as
# stored by this gateway process; the background ones it runs now
RESPONSES_STORED = Counter(
    "pdserve_responses_stored_total", "Stored Responses API responses that ended, by status", ["status"]
)
BACKGROUND_RESPONSES_RUNNING = Gauge(
    "pdserve_background_responses_running", "Background responses this gateway process is running"
)
BACKGROUND_RESPONSES_RESUMED = Counter(
    "pdserve_background_responses_resumed_total",
    "Background responses this gateway process took over from a gateway that died or stopped "
    "before they wrote output, and ran again from the start",
)

# --- prefix cache (tokens) ---
PREFIX_CACHE_QUERIES = Counter(
    "pdserve_prefix_cache_queries_tokens_total", "Prompt tokens looked up in the prefix cache"
)
PREFIX_CACHE_HITS = Counter(
    "pdserve_prefix_cache_hits_tokens_total", "Prompt tokens served from cache", ["source"]
)  # source: local | transferred

# --- workers: KV and loads, per DP rank ---
KV_USAGE_RATIO = Gauge("pdserve_kv_cache_usage_ratio", "Used / total KV blocks", ["dp_rank"])
RANK_USED_TOKENS = Gauge("pdserve_rank_used_tokens", "Tokens in use on a DP rank", ["dp_rank"])
RANK_RUNNING = Gauge("pdserve_rank_running_requests", "Running requests on a DP rank", ["dp_rank"])
RANK_WAITING = Gauge("pdserve_rank_waiting_requests", "Waiting requests on a DP rank", ["dp_rank"])
# The prefill backlog (what a prefill-worker autoscaler scales on; helm/pdserve README).
RANK_WAITING_PROMPT_TOKENS = Gauge(
    "pdserve_rank_waiting_prompt_tokens",
    "Tokens waiting to be prefilled on a DP rank (queued requests + rest of chunked prompts)",
    ["dp_rank"],
)
KV_QUARANTINED_BLOCKS = Gauge(
    "pdserve_kv_quarantined_blocks",
    "KV blocks of a DP rank held back from the pool until a timed-out NIXL READ into them ends "
    "(blocks; a READ cannot be cancelled, its bytes may still land)",
    ["dp_rank"],
)
KV_OFFLOAD_BLOCKS = Counter(
    "pdserve_kv_offload_blocks_total",
    "KV blocks copied into the prefix cache's host tier (direction=save, evicted from the pool) "
    "or back into the pool (direction=restore, a prefix hit there)",
    ["dp_rank", "direction"],
)
KV_OFFLOAD_USAGE_RATIO = Gauge(
    "pdserve_kv_offload_usage_ratio", "Used / total blocks of the prefix cache's host tier", ["dp_rank"]
)
# LoRA adapters on a worker: how many it serves (loaded at start or at run time), and per rank
# and adapter the requests of it now queued, running or held (an adapter with none has no series)
LORA_ADAPTERS = Gauge("pdserve_lora_adapters", "LoRA adapters the worker serves besides its base model")
LORA_REQUESTS = Gauge(
    "pdserve_lora_requests", "Unfinished requests of a LoRA adapter on a DP rank", ["dp_rank", "adapter"]
)
KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total", "KV bytes pushed or received", ["direction"])
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds", "Time to push one request's KV", buckets=_SMALL_BUCKETS_S
)
# Per transport (grpc: the PushKv stream; nixl: the decode worker's READ), from the prefill side
# unless named otherwise. Bandwidth = bytes moved / the handoff's time, per request.
KV_TRANSFER_REQUESTS = Counter(
    "pdserve_kv_transfer_requests_total", "KV handoffs sent to decode workers", ["transport"]
)
KV_TRANSFER_REQUEST_SECONDS = Histogram(
    "pdserve_kv_transfer_request_seconds",
    "Time to hand one request's KV over (send to acknowledgement)",
    ["transport"],
    buckets=_SMALL_BUCKETS_S,
)
KV_TRANSFER_BANDWIDTH = Histogram(
    "pdserve_kv_transfer_bandwidth_bytes_per_second",
    "KV bytes moved per second of handoff, per request",
    ["transport"],
    buckets=(1e7, 1e8, 2.5e8, 5e8, 1e9, 2e9, 4e9, 8e9, 1.6e10, 3.2e10, 6.4e10),
)
# path: nixl (a NIXL READ) or cuda_ipc (a copy from the peer's pool mapped on this host)
KV_TRANSFER_READ_SECONDS = Histogram(
    "pdserve_kv_transfer_read_seconds",
    "Decode side: time of one request's NIXL READ (or same-host CUDA IPC copy), its wait included",
    ["path"],
    buckets=_SMALL_BUCKETS_S,
)
KV_TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures_total",
    "KV handoffs that failed (side=send: on the prefill worker; side=read: a decode worker's NIXL READ)",
    ["transport", "side"],
)
KV_TRANSFER_RECOMPUTES = Counter(
    "pdserve_kv_transfer_recomputes_total",
    "Decode side: requests whose KV READ failed and that recompute their prompt here",
)
PREEMPTIONS = Counter("pdserve_preemptions_total", "Requests preempted by recompute", ["dp_rank"])
# Engine steps by kind (engine/step_stats.py): decode, verify, prefill (prompt chunks only),
# mixed (prompt chunks and decode rows). Mean step time = seconds / steps; tokens per step =
# tokens / steps.
ENGINE_STEPS = Counter("pdserve_engine_steps_total", "Engine steps run", ["dp_rank", "kind"])
ENGINE_STEP_SECONDS = Counter(
    "pdserve_engine_step_seconds_total",
    "Wall time of engine steps (an async step counts from the previous step's end)",
    ["dp_rank", "kind"],
)
ENGINE_STEP_TOKENS = Counter(
    "pdserve_engine_step_tokens_total", "Tokens whose K/V engine steps computed", ["dp_rank", "kind"]
)
# torch's CUDA caching allocator on a worker's GPUs (services/worker/torch_metrics.py): what the
# worker's tensors hold and what the allocator keeps reserved for them, and its retries: each is
# an allocation that failed, after which the allocator synchronized the device, gave its free
# cached blocks back to CUDA and tried again (slow; a step that does it runs several times
# slower), the sign that the KV pool left too little room for the steps' activations.
GPU_MEMORY_ALLOCATED = Gauge(
    "pdserve_gpu_memory_allocated_bytes", "Bytes of GPU memory held by this worker's tensors", ["device"]
)
GPU_MEMORY_RESERVED = Gauge(
    "pdserve_gpu_memory_reserved_bytes",
    "Bytes of GPU memory torch's caching allocator holds for this worker (allocated + cached)",
    ["device"],
)
GPU_ALLOC_RETRIES = Counter(
    "pdserve_gpu_alloc_retries_total",
    "GPU allocations that failed and were retried after the allocator freed its cache",
    ["device"],
)
GPU_OOMS = Counter(
    "pdserve_gpu_ooms_total", "GPU allocations that failed for good (out of memory)", ["device"]
)
# torch.compile in a worker process: the start-up compiles (CUDA), then none while serving; a
# later one stalled a step for as long as it took (seconds)
TORCH_COMPILES = Counter("pdserve_torch_compiles_total", "Frames torch.compile compiled in this process")
# Speculative decoding (vLLM's spec_decode counters are the model): acceptance rate =
# accepted / draft tokens; mean accepted run = accepted / drafts.
SPEC_DRAFTS = Counter(
    "pdserve_spec_decode_num_drafts_total",
    "Verifications of a proposed run (sequences with at least one proposal in a step)",
    ["dp_rank"],
)
SPEC_DRAFT_TOKENS = Counter(
    "pdserve_spec_decode_num_draft_tokens_total", "Proposed tokens verified", ["dp_rank"]
)
SPEC_ACCEPTED_TOKENS = Counter(
    "pdserve_spec_decode_num_accepted_tokens_total", "Proposed tokens accepted", ["dp_rank"]
)
SPEC_ACCEPTED_PER_POSITION = Counter(
    "pdserve_spec_decode_num_accepted_tokens_per_pos_total",
    "Proposed tokens accepted, by position in their run (0 = first proposal)",
    ["dp_rank", "position"],
)
SPEC_STEP_COST_MS = Gauge(
    "pdserve_spec_decode_step_cost_ms",
    "The rank's learned step time: term=fixed (per step), per_seq (per sequence), per_token (per "
    "token beyond each sequence's first, i.e. per proposal verified), verify (once per step that "
    "verifies any proposal); proposals are verified only where their expected acceptance pays "
    "for per_token, and a step's only where together they pay for verify",
    ["dp_rank", "term"],
)

# --- scheduler ---
SCHEDULE_DECISIONS = Counter("pdserve_schedule_decisions_total", "Routing decisions", ["role", "policy"])
PREFILL_MODE = Counter(
    "pdserve_prefill_mode_total", "Requests by where they were prefilled", ["mode"]
)  # mode: disaggregated | local | aggregated
SCHEDULE_SECONDS = Histogram(
    "pdserve_schedule_decision_seconds",
    "Schedule() decision time",
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2),
)

# --- load-monitor ---
REGISTERED_WORKERS = Gauge("pdserve_registered_workers", "Workers with a live lease", ["role"])


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve /metrics on `port` (0 picks a free one; negative disables). Returns the bound port."""
    if port < 0:
        return -1
    try:
        server, _thread = start_http_server(port, addr=addr)
    except OSError as exc:
        raise PortInUse(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
    return int(server.server_port)
