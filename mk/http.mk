# HTTP vs gRPC streaming through the same gateway (TTFT and TPOT per face, and the ratio).
#   make bench-http                    (SmolLM2, CPU fp32; a few minutes)
#   make bench-http HTTP_BENCH_ARGS=--quick
HTTP_BENCH_ARGS ?=
BENCH_TARGETS += bench-http

.PHONY: bench-http
bench-http: install gen
	$(PY) -m benchmarks.bench_http $(HTTP_BENCH_ARGS)
