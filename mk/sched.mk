# Scheduling benchmark (scheduler + load-monitor):
#   make bench-sched   DP-rank balance / TTFT per policy (simulation + real CPU workers) and
#                      Schedule decision latency at 1,000 workers x 8 ranks;
#                      writes benchmarks/results/sched-<machine class>.json. Extra flags: BENCH_SCHED_ARGS=...
BENCH_TARGETS += bench-sched
BENCH_SCHED_ARGS ?=

.PHONY: bench-sched

bench-sched: install gen
	$(PY) -m benchmarks.bench_sched $(BENCH_SCHED_ARGS)
