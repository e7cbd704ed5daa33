#!/usr/bin/env bash
# Generates Python stubs (+ .pyi) from protos/ into $1 (default shared/gen). Never edit the output.
set -euo pipefail
out=${1:-shared/gen}
py=${PYTHON:-.venv/bin/python}
rm -rf "$out"
mkdir -p "$out"
$py -m grpc_tools.protoc -Iprotos --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  protos/pdserve/v1/*.proto
# Generated code imports `pdserve.v1.x`; rewrite to the package the stubs are imported as.
pkg=${GEN_PACKAGE:-shared.gen}  # the import path of $out
find "$out" -name '*.py' -o -name '*.pyi' | xargs sed -i -E "s/^from pdserve\.v1 import/from ${pkg}.pdserve.v1 import/"
touch "$out/__init__.py" "$out/pdserve/__init__.py" "$out/pdserve/v1/__init__.py"
