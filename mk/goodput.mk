# Goodput under latency SLOs: disaggregated vs unified vs conditional, through the HTTP API.
#   make bench-goodput                                   full run (all workloads and configurations; hours on 2 cores)
#   make bench-goodput GOODPUT_ARGS=--quick              a small check of the harness (minutes)
#   make bench-goodput GOODPUT_ARGS="--workloads chat --configs disaggregated,unified_dp2"
#   make bench-goodput GOODPUT_ARGS="--base-url http://HOST:PORT/v1"   any OpenAI-compatible server
#   make bench-goodput GOODPUT_ARGS="--device cuda"      writes benchmarks/results/goodput-cuda-<gpu>.json
# Not part of `make bench` (minutes): a full run takes hours on two cores.
GOODPUT_ARGS ?=

.PHONY: bench-goodput
bench-goodput: install gen
	$(PY) -m benchmarks.bench_goodput $(GOODPUT_ARGS)
