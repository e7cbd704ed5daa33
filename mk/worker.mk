# Worker (prefill / decode / unified roles) checks.
#   make test-worker    unit + integration tests of the worker, and its SIGTERM drain e2e test
.PHONY: test-worker
test-worker: install gen
	$(PY) -m pytest -q -ra tests/unit/worker tests/integration/worker tests/e2e/test_worker_drain.py
