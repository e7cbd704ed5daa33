"""The gateway's settings: flags `--field-name`, env `PDSERVE_FIELD_NAME` (see shared.settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.gateway.reasoning import KINDS as REASONING_PARSERS
from shared.settings import field, parse_settings
from shared.tls import TlsSettings


@dataclass(frozen=True)
class GatewaySettings(TlsSettings):
    """pdserve gateway: the public Generate/Complete/ListModels API in front of the scheduler and workers."""

    listen: str = field("0.0.0.0:50051", "host:port to serve the public gRPC API on")
    http_port: int = field(
        8000,
        "port of the OpenAI-compatible HTTP API (/v1/...), on the host of --listen "
        "(-1 disables it, 0 picks a free one)",
    )
    http_reuse_port: bool = field(
        False,
        "share --http-port with the other gateway processes of this host (SO_REUSEPORT: the kernel "
        "spreads new connections over them); `pdserve up --gateways N` sets it",
    )
    http_max_body_bytes: int = field(
        8 * 1024 * 1024, "largest HTTP request body accepted; larger ones get 413 (bytes)"
    )
    api_keys: tuple[str, ...] = field(
        (),
        "API key every public call must carry as 'authorization: Bearer <key>' (repeatable; env: "
        "comma-separated); health and reflection stay open; none = no authentication",
        repeatable=True,
        aliases=("api-key",),
        secret=True,
    )
    api_key_file: str = field("", "file with more API keys, one per line ('#' comments)")
    metrics_port: int = field(9100, "Prometheus /metrics port (-1 disables, 0 picks a free one)")
    log_level: str = field("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = field("auto", "log format", choices=("auto", "json", "console"))
    drain_grace_s: float = field(30.0, "on SIGTERM, seconds in-flight streams get to finish (s)")
    scheduler_address: str = field("127.0.0.1:50052", "host:port of the scheduler")
    model: str = field(
        "default",
        "tokenizer + chat template source: 'default' (bundled SmolLM2-135M-Instruct) or a model "
        "folder; must be the model the workers serve",
    )
    model_cache_dir: str = field(
        "", "where the default model is converted once ('' = ~/.cache/pdserve/models)"
    )
    block_size: int = field(
        16,
        "tokens per KV block used for the prefix block hashes sent to the scheduler (tokens); "
        "must equal the workers' --block-size or cache-aware routing finds no overlap",
    )
    default_max_tokens: int = field(
        256, "max_tokens when a request leaves it unset and the model recommends none (tokens)"
    )
    generation_config: str = field(
        "auto",
        "What unset sampling fields of a request become (vLLM's --generation-config): auto = the "
        "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as max_tokens), vllm = OpenAI's defaults (temperature 1, no cuts)",
        choices=("auto", "vllm"),
    )
    max_stop_strings: int = field(16, "most stop strings one request may carry (count)")
    max_stop_string_chars: int = field(256, "longest stop string accepted (characters)")
    request_timeout_s: float = field(
        600.0, "longest a request may run, end to end, when the client sets no shorter deadline (s)"
    )
    worker_rpc_timeout_s: float = field(10.0, "timeout of short control RPCs (Schedule, Abort, GetState) (s)")
    tool_call_parser: str = field(
        "",
        "how tool calls are read from chat output: hermes (<tool_call>{json}</tool_call>), "
        'llama3_json ({"name": ..., "parameters": ...}), mistral ([TOOL_CALLS] [{"name": ..., '
        '"arguments": ...}] or name[ARGS]{...}), pythonic (Llama 3.2 / 4: [f(a=1), g(b="x")]) '
        "or qwen3_coder (Qwen3-Coder: <tool_call><function=f><parameter=a>1</parameter>"
        "</function></tool_call>); '' = detected from the chat template (hermes when it says nothing)",
        choices=("", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"),
    )
    reasoning_parser: str = field(
        "",
        "how chat output of reasoning models is split into message.reasoning_content and content: "
        "deepseek_r1 (reasoning up to </think>, the prompt may have opened <think>) or qwen3 "
        "(reasoning only between <think> and </think>); '' = off (all output is content)",
        choices=("", *REASONING_PARSERS),
    )
    log_prompts: bool = field(False, "log prompt and completion text (off by default: privacy)")
    max_inflight_requests: int = field(
        512,
        "requests served at once; more wait in a queue (--max-queued-requests) or are refused "
        "with RESOURCE_EXHAUSTED / HTTP 429 + Retry-After; 0 = no bound (count)",
    )
    max_queued_requests: int = field(
        512,
        "requests that may wait for a slot beyond --max-inflight-requests, served by priority then "
        "arrival; a full queue gives its worst waiter's place to a better request (count)",
    )
    max_queue_wait_s: float = field(10.0, "longest a request waits for a slot before RESOURCE_EXHAUSTED (s)")
    breaker_failures: int = field(
        3,
        "consecutive failures (unavailable) after which a worker gets no traffic from this gateway "
        "for --breaker-cooldown-s, then one probe request; 0 disables the breakers (count)",
    )
    breaker_cooldown_s: float = field(5.0, "how long an open circuit breaker keeps a worker out (s)")
    migration_limit: int = field(
        3,
        "times one request may be moved to another worker after its decode worker failed "
        "mid-stream (the prompt plus the tokens generated so far are prefilled elsewhere and "
        "decoding resumes); past it the client gets UNAVAILABLE; 0 disables migration (count)",
    )
    first_token_before_handoff: bool = field(
        True,
        "disaggregated: the prefill worker answers with the first token as soon as it is sampled "
        "and the KV handoff to the decode worker ends after it (the client gets the first token "
        "while the KV moves; a handoff that fails then moves the request on with that token, like "
        "a migration); off, or with --migration-limit 0: the first token waits for the handoff (a "
        "1.10 or older prefill worker always waits)",
    )
    membership_poll_s: float = field(
        1.0,
        "while streams are in flight, how often the scheduler's membership is checked: a decode "
        "worker carrying a stream that left it (lease expired, deregistered) and does not answer a "
        "health check within --membership-probe-timeout-s has its streams migrated; 0 disables "
        "(such streams then wait for their deadline) (s)",
    )
    membership_probe_timeout_s: float = field(
        2.0, "how long a worker that left membership gets to answer a health check (s)"
    )
    allow_runtime_lora_updating: bool = field(
        False,
        "serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (gRPC "
        "LoadLoraAdapter / UnloadLoraAdapter): load a LoRA adapter into every worker of the base "
        "model, which must run with --enable-lora, or unload one; off: PERMISSION_DENIED / 403. "
        "Workers that join later do not get such adapters (--lora-modules is for those that must "
        "survive restarts and scale-out)",
    )
    lora_update_timeout_s: float = field(
        120.0, "longest one worker may take to load (or unload) a LoRA adapter at runtime (s)"
    )
    batch_dir: str = field(
        "",
        "folder of OpenAI's Files and Batch APIs (/v1/files, /v1/batches): uploads, batch records "
        "and results; gateways that share it share files and batches, and one resumes a batch "
        "whose gateway died; '' = both APIs off (pdserve up gives one)",
    )
    batch_concurrency: int = field(16, "requests of batches in flight at once, all batches (count)")
    batch_priority: int = field(
        10,
        "priority of a batch's requests unless a request sets one (lower is served first; "
        "interactive requests default to 0, so batches fill what they leave)",
    )
    max_batch_file_bytes: int = field(200 * 1024 * 1024, "largest file /v1/files accepts (bytes)")
    max_batch_lines: int = field(50_000, "most requests in one batch's input file (count)")
    batch_poll_s: float = field(
        2.0, "how often batches are looked for (those left by a gateway that died) and cancels (s)"
    )
    batch_retention_s: float = field(
        30 * 24 * 3600.0,
        "how long a finished batch (its record, output and error files) is kept after it ended, "
        "and an uploaded file after it was made unless an unfinished batch reads it; 0 = forever (s)",
    )
    response_dir: str = field(
        "",
        "folder of stored Responses API responses (store, previous_response_id, background, GET / "
        "DELETE /v1/responses/{id}) and of the Conversations API (/v1/conversations); gateways "
        "that share it share them; '' = nothing stored (pdserve up gives one)",
    )
    response_retention_s: float = field(
        30 * 24 * 3600.0, "how long a stored response is kept after it was created; 0 = forever (s)"
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_stop_strings < 0 or self.max_stop_string_chars < 1:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_string_chars >= 1")
        if self.request_timeout_s <= 0 or self.worker_rpc_timeout_s <= 0:
            raise ValueError("request_timeout_s and worker_rpc_timeout_s must be > 0")
        if self.http_port < -1 or self.http_port > 65535:
            raise ValueError(f"http_port must be -1 (off), 0 (any free port) or a port, got {self.http_port}")
        if self.http_max_body_bytes < 1024:
            raise ValueError(f"http_max_body_bytes must be >= 1024, got {self.http_max_body_bytes}")
        if self.max_inflight_requests < 0 or self.max_queued_requests < 0:
            raise ValueError("max_inflight_requests and max_queued_requests must be >= 0")
        if self.max_queue_wait_s <= 0 or self.breaker_cooldown_s <= 0 or self.breaker_failures < 0:
            raise ValueError("max_queue_wait_s and breaker_cooldown_s must be > 0, breaker_failures >= 0")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.membership_poll_s < 0 or self.membership_probe_timeout_s <= 0:
            raise ValueError("membership_poll_s must be >= 0 and membership_probe_timeout_s > 0")
        if self.lora_update_timeout_s <= 0:
            raise ValueError(f"lora_update_timeout_s must be > 0, got {self.lora_update_timeout_s}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.batch_concurrency < 1 or self.max_batch_lines < 1 or self.max_batch_file_bytes < 1:
            raise ValueError("batch_concurrency, max_batch_lines and max_batch_file_bytes must be >= 1")
        if self.batch_poll_s <= 0 or self.batch_retention_s < 0:
            raise ValueError("batch_poll_s must be > 0 and batch_retention_s >= 0")
        if self.response_retention_s < 0:
            raise ValueError(f"response_retention_s must be >= 0, got {self.response_retention_s}")


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> GatewaySettings:
    return parse_settings(GatewaySettings, argv, env, prog="pdserve gateway")
