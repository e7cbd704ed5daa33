# Worker engine benchmark: pdserve's engine vs transformers generate / generate_batch, same run.
#   make bench-engine                    full run (16 requests, SmolLM2, CPU fp32; a few minutes)
#   make bench-engine ENGINE_BENCH_ARGS=--quick
#   make bench-engine ENGINE_BENCH_ARGS="--device cuda --dtype bfloat16"
ENGINE_BENCH_ARGS ?=
BENCH_TARGETS += bench-engine

.PHONY: bench-engine
bench-engine: install
	$(PY) -m benchmarks.bench_engine $(ENGINE_BENCH_ARGS)
