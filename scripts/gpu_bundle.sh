#!/usr/bin/env bash
# What a lent GPU machine needs from here, made once per checkout (both folders are git-ignored
# through .git/info/exclude; the device tool carries them, 64 MiB a call in all):
#   .whl/         the runtime pins (requirements/runtime.txt) that the GPU image lacks and the
#                 test pins its tests import, as cp312 manylinux x86_64 wheels (~37 MB); the image
#                 has torch (CUDA), numpy, protobuf, prometheus-client, accelerate, safetensors
#                 and the rest of transformers' needs
#   .gpu/models/  the tokenizer + config folders of `random:llama-8b` and `random:smollm2` (3.5 MB
#                 each; the weights are drawn on the GPU)
# Then, on the device (carry .whl .gpu shared/gen):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   mkdir -p ~/.cache/pdserve/models && cp -r .gpu/models/* ~/.cache/pdserve/models/
#   RESULTS_DIR=$OUT GPU_TAG=h200 scripts/gpu_checks.sh tests   (then big, serving)
#   .gpu/nixl.tar.xz  nixl-cu13 trimmed to the KV READ's needs (scripts/nixl_bundle.sh, 8.3 MB);
#                 on the device: tar -C /tmp/site -xJf .gpu/nixl.tar.xz (the wheel, 59 MB, would not
#                 fit beside the rest)
# Not carried: grpcio-tools (shared/gen travels built) and hf-xet (the image has it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# the pins the H100/H200 images lacked (found by importing pdserve there, 2026-11)
NEEDED="annotated-doc annotated-types anyio click fastapi googleapis-common-protos grpcio
grpcio-health-checking grpcio-reflection httpcore httpcore2 httptools httpx2
huggingface-hub llguidance opentelemetry-api opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-proto
opentelemetry-sdk opentelemetry-semantic-conventions pydantic pydantic-core python-dotenv python-multipart
shellingham starlette structlog tokenizers transformers truststore typer typing-inspection uvicorn
watchfiles websockets wrapt"
pins=()
for name in $NEEDED; do
  pin=$(grep -i "^${name}==" requirements/runtime.txt | awk '{print $1}') || true
  [[ -n $pin ]] || { echo "no pin for $name in requirements/runtime.txt" >&2; exit 1; }
  pins+=("$pin")
done
# and the test pins that modules collected by `pytest -m gpu` import (openai, jsonschema; the
# H200 image lacked them, 2026-11-28: 7 collection errors; peft: the LoRA test's reference)
for name in pytest-asyncio openai jiter sniffio jsonschema jsonschema-specifications attrs \
  referencing rpds-py peft; do
  pin=$(grep -i "^${name}==" requirements/dev.txt | awk '{print $1}') || true
  [[ -n $pin ]] || { echo "no pin for $name in requirements/dev.txt" >&2; exit 1; }
  pins+=("$pin")
done
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
for m in llama-8b llama-70b smollm2; do  # add qwen2.5-7b here when a check needs it
  $PY -c "from shared.model_store import resolve_model; print(resolve_model('random:$m'))"
done
mkdir -p .gpu/models
cp -r ~/.cache/pdserve/models/random-{llama-8b,llama-70b,smollm2} .gpu/models/
scripts/nixl_bundle.sh "" .gpu/nixl.tar.xz
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
du -sh .whl .gpu
