#!/usr/bin/env bash
# nixl-cu13 for a lent GPU, trimmed to what a KV READ between two agents needs: the wheel is 59 MB
# (238 MB installed: expert-parallel kernels for three torch versions, storage plugins, InfiniBand
# and cloud SDK libraries), which does not fit beside .whl in one device call (64 MiB). Kept: the
# Python API, libnixl, the UCX plugin and UCX's shared-memory (cma) and CUDA transports, and every
# library those need (followed through readelf's NEEDED entries). Result: a 9 MB tar.xz of an
# installed folder; on the device: `mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/nixl.tar.xz`.
#   scripts/nixl_bundle.sh [WHEEL] [OUT]   (default: downloads nixl-cu13==1.5.1 for cp312)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${2:-.gpu/nixl.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=${1:-}
if [[ -z $wheel ]]; then
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work" nixl-cu13==1.5.1
  wheel=$(ls "$work"/nixl_cu13-*.whl)
fi
site=$work/site
mkdir -p "$site"
(cd "$site" && unzip -q "$wheel")
cd "$site"
rm -rf nixl_ep_cu13 nixl_cu13.scripts nixl_cu13-*.data
for dir in nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins; do
  find "$dir" -name '*.so' ! -name libplugin_UCX.so ! -name 'libtelemetry_exporter_prometheus*' \
    ! -name libtrace_backend_nvtx.so -delete
done
rm -f nixl_cu13.libs/ucx/libuct_ib* nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/*.la
rm -f .nixl_cu13.mesonpy.libs/{libobj_utils.so,libnixl_test_utils.so,liburing.so.*,libfile_utils.so}
needed() { find . -name '*.so*' -type f -exec readelf -d {} + 2>/dev/null | awk '/NEEDED/{gsub(/[][]/,"",$5); print $5}' | sort -u; }
while true; do  # drop the bundled libraries nothing left needs, until none is dropped
  keep=$(needed)
  gone=0
  for lib in nixl_cu13.libs/*.so*; do
    if ! grep -qxF "$(basename "$lib")" <<<"$keep"; then rm -f "$lib"; gone=1; fi
  done
  [[ $gone == 1 ]] || break
done
cd - >/dev/null
mkdir -p "$(dirname "$out")"
tar -C "$site" -cJf "$out" .
du -h "$out"
