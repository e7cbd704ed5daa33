# Worker engine benchmark: pdserve's engine vs transformers generate / generate_batch, same run.
#   make bench-engine                    full run (16 requests, SmolLM2, CPU fp32; a few minutes)
#   make bench-engine ENGINE_BENCH_ARGS=--quick
#   make bench-engine ENGINE_BENCH_ARGS="--device cuda --dtype bfloat16"
ENGINE_BENCH_ARGS ?=
BENCH_TARGETS += bench-engine

.PHONY: bench-engine
bench-engine: install
	$(PY) -m benchmarks.bench_engine $(ENGINE_BENCH_ARGS)

# Sampling-feature overhead: the 8-sequence decode step with logprobs / penalties vs plain, one run.
#   make bench-sampling                  (SmolLM2, CPU fp32, one thread; ~2 minutes)
SAMPLING_BENCH_ARGS ?=
BENCH_TARGETS += bench-sampling

.PHONY: bench-sampling
bench-sampling: install
	$(PY) -m benchmarks.bench_sampling $(SAMPLING_BENCH_ARGS)

# Host time per decode step by phase (issue 31) at 1/8/64 requests, on random:tiny (negligible
# compute, the real vocabulary).
#   make bench-host-overhead             (CPU, one thread; ~1 minute)
HOST_OVERHEAD_BENCH_ARGS ?=
BENCH_TARGETS += bench-host-overhead

.PHONY: bench-host-overhead
bench-host-overhead: install
	$(PY) -m benchmarks.host_overhead $(HOST_OVERHEAD_BENCH_ARGS)

# The prefix cache's host tier (--kv-offload-tokens): TTFT of a prompt revisited after other
# prompts evicted it from the pool, served from the pool, from the host tier, and recomputed.
#   make bench-kv-offload                (random:smollm2 shape, CPU; ~1-2 minutes)
#   make bench-kv-offload KV_OFFLOAD_BENCH_ARGS="--device cuda --model random:llama-8b --prompt-tokens 2048"
KV_OFFLOAD_BENCH_ARGS ?=
BENCH_TARGETS += bench-kv-offload

.PHONY: bench-kv-offload
bench-kv-offload: install
	$(PY) -m benchmarks.kv_offload $(KV_OFFLOAD_BENCH_ARGS)

# What serving through LoRA adapters costs (--lora-modules): decode TPOT with every request on
# the base model, on one adapter, mixed over the base model and 4 adapters; prefill TTFT base
# vs adapter (random rank-16 adapters on every projection, written as PEFT folders).
#   make bench-lora                      (random:smollm2 shape, CPU; ~1 minute)
#   make bench-lora LORA_BENCH_ARGS="--device cuda --model random:llama-8b --batch 16"
LORA_BENCH_ARGS ?=
BENCH_TARGETS += bench-lora

.PHONY: bench-lora
bench-lora: install
	$(PY) -m benchmarks.lora $(LORA_BENCH_ARGS)
