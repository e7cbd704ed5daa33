# Stack benchmarks: KV transfer vs prefill time; end-to-end overhead vs the in-process engine.
#   make bench-stack                   (SmolLM2, CPU fp32; about two minutes)
#   make bench-stack STACK_BENCH_ARGS=--quick
#   make bench-stack STACK_BENCH_ARGS="--device cuda --dtype bfloat16 --model random:llama-8b"
#                                      (on a GPU, stacks one after another; results/stack-cuda-<gpu>.json;
#                                      also scripts/gpu_checks.sh stack)
STACK_BENCH_ARGS ?=
BENCH_TARGETS += bench-stack

.PHONY: bench-stack
bench-stack: install gen
	$(PY) -m benchmarks.bench_stack $(STACK_BENCH_ARGS)
