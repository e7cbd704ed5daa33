# What a running batch (the Batch API) costs interactive traffic: TTFT / TPOT alone, beside a
# batch at its default priority, beside the same batch at interactive priority.
#   make bench-batch                    (SmolLM2, CPU fp32, unified; ~5 minutes)
#   make bench-batch BATCH_BENCH_ARGS=--quick
BATCH_BENCH_ARGS ?=
BENCH_TARGETS += bench-batch

.PHONY: bench-batch
bench-batch: install gen
	$(PY) -m benchmarks.bench_batch $(BATCH_BENCH_ARGS)
