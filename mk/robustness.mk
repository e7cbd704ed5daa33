# Robustness runs that are too long for CI: a longer fuzz of every API (hypothesis).
FUZZ_EXAMPLES ?= 400
.PHONY: fuzz
fuzz: install gen
	PDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -ra tests/integration/stack/test_fuzz.py

# N minutes of mixed load with cancels; prints each service's RSS series and a pass/fail line.
SOAK_ARGS ?= --minutes 30
.PHONY: soak
soak: install gen
	$(PY) -m benchmarks.soak $(SOAK_ARGS)
