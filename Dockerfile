# syntax=docker/dockerfile:1
# The pdserve image: the `pdserve` command, from which every service runs (`pdserve gateway`,
# `pdserve prefill-worker`, ... as the Helm chart does, or `pdserve up` for the whole stack).
#
#   make image                       -> pdserve:<version>        torch CPU build
#   make image IMAGE_VARIANT=cuda    -> pdserve:<version>-cuda   torch CUDA build from PyPI (it
#                                       carries the CUDA runtime; the node provides the driver)
#
# pdserve is installed by scripts/install.sh, the script `make install` runs in CI, from
# requirements/runtime.txt (the versions of requirements/dev.txt that CI tests).
# At run time: uid/gid 10001, read-only root filesystem. Writable: /tmp (HOME, Hugging Face and
# torch caches, temporary files) and /var/cache/pdserve (PDSERVE_MODEL_CACHE_DIR, where the bundled
# default model is converted on first start), both volumes in the Helm chart.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment in /opt/pdserve ----------------------------------------------
FROM ${PYTHON_IMAGE} AS build
# cpu: torch from PyTorch's CPU wheel index (no CUDA libraries); cuda: torch from PyPI.
ARG TORCH_VARIANT=cpu
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHON=/opt/pdserve/bin/python
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
RUN python -m venv /opt/pdserve
# Dependencies first (their own layer, rebuilt only when the lock file changes).
COPY scripts/install.sh scripts/gen_protos.sh scripts/
COPY requirements/runtime.txt requirements/
RUN if [ "$TORCH_VARIANT" = cpu ]; then export PDSERVE_TORCH_INDEX_URL="$TORCH_CPU_INDEX_URL"; \
    elif [ "$TORCH_VARIANT" != cuda ]; then echo "TORCH_VARIANT must be cpu or cuda" >&2; exit 1; fi; \
    INSTALL_STEPS=deps scripts/install.sh requirements/runtime.txt
# Then pdserve: stubs generated from protos/, the package, the default model package, NIXL (the
# KV transport between workers), pip check.
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY shared/ shared/
COPY services/ services/
RUN INSTALL_STEPS="stubs project model nixl check" scripts/install.sh requirements/runtime.txt \
    && /opt/pdserve/bin/pdserve --help > /dev/null
# The CPU decode kernels (services/worker/engine/cpu_kernels.py) compiled here, where g++ can be
# installed: the runtime image has no compiler and a read-only root filesystem, and loads this
# build as it is (x86-64 only: the kernels are AVX2 / AVX-512). From /tmp, so that `services` is
# the installed package and not /src's copy.
# g++ unpinned: a build-stage tool that never reaches the runtime image; any bookworm g++ builds
# the same source.
WORKDIR /tmp
# hadolint ignore=DL3008
RUN if [ "$(uname -m)" = x86_64 ]; then \
      apt-get update && apt-get install -y --no-install-recommends g++ \
      && rm -rf /var/lib/apt/lists/* \
      && /opt/pdserve/bin/python -m services.worker.engine.cpu_kernels --prebuild; \
    fi

# ---- runtime ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
ARG PDSERVE_VERSION=0.1.0
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="LLM serving with prefill/decode disaggregation: five gRPC services" \
      org.opencontainers.image.version="${PDSERVE_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.pdserve.torch-variant="${TORCH_VARIANT}"
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin pdserve \
    && install -d -o 10001 -g 10001 -m 0750 /var/cache/pdserve
COPY --from=build /opt/pdserve /opt/pdserve
# HOME=/tmp: every cache that follows HOME lands on the writable /tmp volume.
# NVIDIA_DRIVER_CAPABILITIES is read only by the NVIDIA container runtime (CUDA variant).
ENV PATH=/opt/pdserve/bin:$PATH \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    PDSERVE_MODEL_CACHE_DIR=/var/cache/pdserve \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/var/cache/pdserve"]
WORKDIR /tmp
USER 10001:10001
# gRPC: gateway, scheduler, load-monitor, prefill-worker, decode-worker; then their /metrics ports.
EXPOSE 50051 50052 50053 50061 50071 9100 9101 9102 9103 9104
ENTRYPOINT ["pdserve"]
CMD ["--help"]
