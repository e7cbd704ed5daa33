# Speculative decoding benchmark: speculation off vs ngram, grounded and open-ended workloads,
# concurrency 1 and 8, on the default model (CPU fp32); writes benchmarks/results/spec-<machine class>.json + .png
# (spec-cpu-avx512.json; benchmarks/result_names.py).
#   make bench-spec                       full run (several minutes on 2 cores)
#   make bench-spec SPEC_BENCH_ARGS=--quick
#   make bench-spec SPEC_BENCH_ARGS="--repeat 3"     steadier ratios on a shared machine
#   make bench-spec SPEC_BENCH_ARGS=--no-step-cost   every proposal verified (no cost model)
SPEC_BENCH_ARGS ?=
BENCH_TARGETS += bench-spec

.PHONY: bench-spec
bench-spec: install gen
	$(PY) -m benchmarks.bench_spec $(SPEC_BENCH_ARGS)
