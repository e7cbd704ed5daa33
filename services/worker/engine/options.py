"""The engine's options as flags: the model backend's (`BackendOptions`), speculation's
(`SpecOptions`) and the batch and pool sizes (`EngineOptions`, which holds them all). The
engine's config (api.EngineConfig) and the worker's settings (services/worker/settings.py)
embed `EngineOptions`, so each option is declared once, with its help text and default; its
flag is `--name-with-dashes` and its environment variable `PDSERVE_NAME` (shared/settings.py).
No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from shared.settings import field


@dataclass(frozen=True)
class BackendOptions:
    """The backend flags as configured (EngineConfig and WorkerSettings embed them)."""

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
        "needs the lean forward); ignored on CPU. --no-cuda-graphs may suit a small model whose GPU "
        "other processes share: without MPS their kernels wait for time slices behind the graphs",
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


@dataclass(frozen=True)
class SpecOptions:
    """Speculative decoding (engine/spec)."""

    speculative: str = field(
        "off",
        "Speculative decoding: off, ngram (prompt lookup over the prompt and output), or draft "
        "(a smaller model with the same tokenizer proposes: --draft-model)",
        choices=("off", "ngram", "draft"),
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


@dataclass(frozen=True)
class EngineOptions(BackendOptions, SpecOptions):
    """Every engine option a worker's flags set: batch and pool sizes, the model backend's,
    speculation's."""

    dp_size: int = field(1, "Data-parallel ranks (model replicas) in this process")
    cuda_devices: str = field(
        "",
        "On CUDA, the GPUs this worker's ranks run on, as indices of the visible devices (e.g. "
        "'2,3'): rank r on the (r mod n)-th of them; empty = every visible GPU. pdserve up sets it "
        "to spread its workers over a machine's GPUs",
    )
    block_size: int = field(16, "Tokens per KV block")
    kv_cache_tokens: int = field(
        0,
        "KV pool size per rank (tokens); 0 = what --gpu-memory-utilization leaves (CUDA), else "
        "from free memory",
    )
    kv_offload_tokens: int = field(
        0,
        "Host-memory tier of the prefix cache per rank (tokens): full KV blocks the pool evicts "
        "are kept there (least recently used dropped first) and copied back when a later prompt "
        "continues past its hits in the pool, instead of being recomputed; 0 = off. Costs "
        "tokens x the model's KV bytes per token of host RAM (pinned on CUDA)",
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
    priority_preemption: bool = field(
        True,
        "When every running slot, or the KV blocks it needs, is taken, a waiting request of "
        "strictly better (lower) priority preempts the worst-priority running one (which "
        "recomputes later) instead of waiting for it to finish; with every priority equal nothing "
        "changes",
    )
    async_scheduling: bool | None = field(
        None,
        "Schedule and launch the next decode step while the device runs the current one (its "
        "input ids come from the current step's draws on the device; outputs unchanged); off for "
        "steps with prefill chunks, aborts, logprobs, penalties, min_tokens, bad_words, a thinking "
        "budget, structured output "
        "and with speculative decoding (engine/rank.py). Default (unset): on for CUDA, off on CPU",
    )
    enable_lora: bool = field(
        False,
        "Serve LoRA adapters loaded while the worker runs (the gateway's load_lora_adapter, "
        "with its --allow-runtime-lora-updating); --lora-modules turns it on too",
    )
    lora_modules: tuple[str, ...] = field(
        (),
        "LoRA adapters served besides the base model, as NAME=PATH (repeatable; the environment "
        "variable takes them comma-separated): PATH a PEFT adapter folder (adapter_config.json + "
        "adapter_model.safetensors) of this model; NAME is the model id requests use. All are "
        "loaded at start and requests of different adapters share steps",
        repeatable=True,
    )
    quantization: str = field(
        "",
        "Weights of the decoder layers' linear products: '' = the model's dtype; fp8 = float8 e4m3 "
        "with a scale per output channel, inputs quantized per token as each product runs (vLLM's "
        "online FP8: half the weight bytes of bf16; GPUs of compute capability 9.0 or more, or the "
        "CPU for tests). The embedding, LM head, norms and KV cache keep --dtype. Give prefill and "
        "decode workers the same value. A checkpoint stored in FP8 (compressed-tensors "
        "float-quantized, fbgemm_fp8) is served in FP8 whatever this says",
        choices=("", "fp8"),
    )
    max_model_len: int = field(0, "Longest prompt + generation (tokens); 0 = the model's limit")
    torch_threads: int = field(0, "torch intra-op threads; 0 = torch default")
