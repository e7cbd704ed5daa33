#!/usr/bin/env bash
# Builds the pdserve image (Dockerfile) with the builder this machine can run: docker with a
# reachable engine, podman, or buildah (IMAGE_BUILDER=... picks one).
#   scripts/build_image.sh [--dry-run]
#   IMAGE_VARIANT=cpu|cuda (default cpu)   IMAGE_REPOSITORY (default pdserve)
# Tag: <repository>:<version> for cpu, <repository>:<version>-cuda for cuda, where <version> is
# pyproject.toml's version (= the chart's appVersion, the chart's default image tag).
# --dry-run prints the build command and builds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=""
[ "${1:-}" = "--dry-run" ] && dry_run=1
variant=${IMAGE_VARIANT:-cpu}
repository=${IMAGE_REPOSITORY:-pdserve}
version=$(sed -nE 's/^version = "([^"]+)"$/\1/p' pyproject.toml)
[ -n "$version" ] || { echo "build_image: no version in pyproject.toml" >&2; exit 1; }
case $variant in
  cpu) tag=$version ;;
  cuda) tag=$version-cuda ;;
  *) echo "build_image: IMAGE_VARIANT must be cpu or cuda, not $variant" >&2; exit 2 ;;
esac
image=$repository:$tag

# A builder that can run here, or the reason why none can.
usable() {
  case $1 in
    docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
    podman) command -v podman >/dev/null && podman info >/dev/null 2>&1 ;;
    buildah) command -v buildah >/dev/null && buildah --version >/dev/null 2>&1 ;;
    *) return 1 ;;
  esac
}
builder=${IMAGE_BUILDER:-}
if [ -z "$builder" ]; then
  for b in docker podman buildah; do
    if usable "$b"; then builder=$b; break; fi
  done
fi
if [ -z "$builder" ] && [ -n "$dry_run" ]; then
  builder=docker
fi
if [ -z "$builder" ]; then
  echo "build_image: no image builder can run on this machine." >&2
  if command -v docker >/dev/null; then
    echo "  docker: the client is installed, but no Docker engine answers (docker info fails)." >&2
  fi
  echo "  Install and start one of docker (with its engine), podman or buildah, then run make image." >&2
  exit 1
fi

args=(build -f Dockerfile --build-arg "TORCH_VARIANT=$variant" --build-arg "PDSERVE_VERSION=$version"
  -t "$image" .)
echo "$builder ${args[*]}"
[ -n "$dry_run" ] && exit 0
"$builder" "${args[@]}"
echo "built $image"
