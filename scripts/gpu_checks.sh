#!/usr/bin/env bash
# GPU checks, for a machine with CUDA (CI has none): the CUDA tests, then the benchmarks with
# --device cuda. Results go to their own files (*-cuda*.json) so CPU figures are never mixed in.
#   scripts/gpu_checks.sh [tests|engine|all]     PYTHON=... RESULTS_DIR=... override defaults
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${RESULTS_DIR:-benchmarks/results}
what=${1:-all}
mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, torch.cuda.get_device_name(0))'
rc=0
if [[ $what == tests || $what == all ]]; then
  $PY -m pytest -q -ra -p no:cacheprovider tests/integration/worker/test_worker_gpu.py \
    tests/unit/engine/test_engine_api.py -k cuda || rc=1
fi
if [[ $what == engine || $what == all ]]; then
  $PY -m benchmarks.bench_engine --device cuda --dtype bfloat16 \
    --output "$RES/engine-cuda.json" || rc=1
fi
exit $rc
