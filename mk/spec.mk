# Speculative decoding benchmark: speculation off vs ngram, grounded and open-ended workloads,
# concurrency 1 and 8, on the default model (CPU fp32); writes benchmarks/results/spec.json + .png.
#   make bench-spec                       full run (several minutes on 2 cores)
#   make bench-spec SPEC_BENCH_ARGS=--quick
SPEC_BENCH_ARGS ?=
BENCH_TARGETS += bench-spec

.PHONY: bench-spec
bench-spec: install gen
	$(PY) -m benchmarks.bench_spec $(SPEC_BENCH_ARGS)
