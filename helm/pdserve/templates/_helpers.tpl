{{/*
Shared helpers of the pdserve chart.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-pdserve, or the release name when it already contains the chart name. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The five services, in start order: values key -> fixed facts about each. */}}
{{- define "pdserve.components" -}}
loadMonitor:
  name: load-monitor
  command: load-monitor
  healthService: pdserve.v1.LoadMonitor
  worker: false
  needsModel: false
scheduler:
  name: scheduler
  command: scheduler
  healthService: pdserve.v1.Scheduler
  worker: false
  needsModel: false
prefillWorker:
  name: prefill-worker
  command: prefill-worker
  healthService: pdserve.v1.Worker
  worker: true
  needsModel: true
decodeWorker:
  name: decode-worker
  command: decode-worker
  healthService: pdserve.v1.Worker
  worker: true
  needsModel: true
gateway:
  name: gateway
  command: gateway
  healthService: pdserve.v1.Gateway
  worker: false
  needsModel: true
{{- end }}

{{- define "pdserve.componentKeys" -}}
- loadMonitor
- scheduler
- prefillWorker
- decodeWorker
- gateway
{{- end }}

{{/* Labels shared by every object. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Selector of every pod of this release. */}}
{{- define "pdserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector of one component's pods; call with (dict "root" $ "name" "gateway"). */}}
{{- define "pdserve.selectorLabels" -}}
{{ include "pdserve.releaseSelector" .root }}
app.kubernetes.io/component: {{ .name }}
{{- end }}

{{/* Object name of one component; call with (dict "root" $ "name" "gateway"). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag; the default tag is appVersion (cpu) or appVersion-cuda, as `make image` tags. */}}
{{- define "pdserve.image" -}}
{{- $default := .Chart.AppVersion }}
{{- if eq (.Values.image.variant | default "cpu") "cuda" }}{{ $default = printf "%s-cuda" .Chart.AppVersion }}{{ end }}
{{- printf "%s:%s" .Values.image.repository (default $default (toString .Values.image.tag)) }}
{{- end }}

{{/* A value as an env var string: whole floats without exponent, lists comma-joined. */}}
{{- define "pdserve.envString" -}}
{{- if kindIs "float64" . }}
{{- if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if kindIs "slice" . }}
{{- join "," . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* In-cluster address of a component's gRPC port; call with (dict "root" $ "key" "scheduler"). */}}
{{- define "pdserve.address" -}}
{{- $c := index (fromYaml (include "pdserve.components" .root)) .key }}
{{- $v := index .root.Values .key }}
{{- printf "%s:%s" (include "pdserve.componentName" (dict "root" .root "name" $c.name)) (include "pdserve.envString" $v.port) }}
{{- end }}

{{/* terminationGracePeriodSeconds: drain grace + preStop sleep + margin (whole seconds). */}}
{{- define "pdserve.terminationGrace" -}}
{{- $c := .Values.common }}
{{- add (int64 (ceil $c.drainGraceS)) (int64 $c.terminationGraceExtraS) (int64 $c.preStopSleepS) }}
{{- end }}

{{/*
One probe; call with (dict "root" $ "port" 50051 "service" "pdserve.v1.Gateway" "host" <service name>
"cfg" .Values.probes.x "failureThreshold" n). Native gRPC probe, or with TLS an exec of a Python health check (the
kubelet's gRPC probe cannot speak TLS).
*/}}
{{- define "pdserve.probe" -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command:
    - python
    - -c
    - |
      import sys, grpc
      from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
      d = "/etc/pdserve/tls/"
      rd = lambda n: open(d + n, "rb").read()
      mutual = {{ if .root.Values.tls.mutual }}True{{ else }}False{{ end }}
      creds = grpc.ssl_channel_credentials(rd("ca.crt"), rd("tls.key") if mutual else None, rd("tls.crt") if mutual else None)
      ch = grpc.secure_channel("127.0.0.1:{{ .port }}", creds, options=[("grpc.ssl_target_name_override", "{{ .root.Values.tls.serverName | default .host }}")])
      r = g.HealthStub(ch).Check(h.HealthCheckRequest(service="{{ .service }}"), timeout={{ .cfg.timeoutSeconds }})
      sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)
{{- else -}}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
periodSeconds: {{ .cfg.periodSeconds }}
timeoutSeconds: {{ .cfg.timeoutSeconds }}
failureThreshold: {{ .failureThreshold | default .cfg.failureThreshold }}
{{- end }}
