{{/* Helpers of the moesplit chart. Every helper is prefixed with the chart name. */}}

{{- define "moesplit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "moesplit.fullname" -}}
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

{{- define "moesplit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels; pass a dict {"ctx": $, "component": "gpu"|"experts"|...}. */}}
{{- define "moesplit.labels" -}}
helm.sh/chart: {{ include "moesplit.chart" .ctx }}
{{ include "moesplit.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: moesplit
{{- end }}

{{- define "moesplit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moesplit.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image of one component; pass {"ctx": $, "which": "experts"|"gpu"} (scripts/build_images.sh builds both). */}}
{{- define "moesplit.image" -}}
{{- $img := index .ctx.Values.image .which }}
{{- $repo := required (printf "image.%s.repository is required (an image with the `moesplit` entry point)" .which) $img.repository }}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion $img.tag) }}
{{- end }}

{{- define "moesplit.gpuName" -}}
{{- printf "%s-gpu" (include "moesplit.fullname" .) }}
{{- end }}

{{- define "moesplit.expertsServiceName" -}}
{{- printf "%s-experts" (include "moesplit.fullname" .) }}
{{- end }}

{{/* StatefulSet name of one shard group; pass {"ctx": $, "group": $g}. */}}
{{- define "moesplit.expertsGroupName" -}}
{{- $gname := required "experts.groups[].name is required (a DNS label such as numa0)" .group.name }}
{{- $name := printf "%s-experts-%s" (include "moesplit.fullname" .ctx) $gname }}
{{- if gt (len $name) 52 }}
{{- fail (printf "StatefulSet name %q is longer than 52 characters: shorten the release name, fullnameOverride or experts.groups[].name" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* The `moesplit expert-server` shard arguments of one group: --slice i/n or --experts a-b. */}}
{{- define "moesplit.shardArgs" -}}
{{- if and .slice .experts }}
{{- fail (printf "experts.groups[%s]: set either slice or experts, not both" .name) }}
{{- else if .slice }}
- --slice
- {{ .slice | quote }}
{{- else if .experts }}
- --experts
- {{ .experts | quote }}
{{- else }}
{{- fail (printf "experts.groups[%s]: set slice (\"i/n\") or experts (\"a-b\") from the memory plan" .name) }}
{{- end }}
{{- end }}

{{/* Comma-separated stable DNS addresses of every expert pod: replica set 0 of every group, then replica set 1... */}}
{{- define "moesplit.shardAddresses" -}}
{{- $svc := include "moesplit.expertsServiceName" . }}
{{- $addrs := list }}
{{- range $r := until (int .Values.experts.redundancy) }}
{{- range $g := $.Values.experts.groups }}
{{- $sts := include "moesplit.expertsGroupName" (dict "ctx" $ "group" $g) }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.cluster.local:%d" $sts $r $svc $.Release.Namespace (int $.Values.experts.port)) }}
{{- end }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{- define "moesplit.modelPath" -}}
{{- $p := required "model.path is required: the checkpoint directory inside the containers" .Values.model.path }}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) $p) }}
{{- fail (printf "model.path %q must lie under model.mountPath %q" $p .Values.model.mountPath) }}
{{- end }}
{{- $p }}
{{- end }}

{{/* The weights volume (PVC or hostPath). */}}
{{- define "moesplit.modelVolume" -}}
- name: model
{{- if eq .Values.model.source.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.source.claimName is required when model.source.type is pvc" .Values.model.source.claimName }}
    readOnly: {{ .Values.model.readOnly }}
{{- else if eq .Values.model.source.type "hostPath" }}
  hostPath:
    path: {{ required "model.source.hostPath is required when model.source.type is hostPath" .Values.model.source.hostPath }}
    type: Directory
{{- else }}
{{- fail (printf "model.source.type must be pvc or hostPath, not %q" .Values.model.source.type) }}
{{- end }}
{{- end }}

{{- define "moesplit.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ .Values.model.readOnly }}
{{- end }}

{{- define "moesplit.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert
- {{ printf "%s/tls.crt" .Values.tls.mountPath }}
- --tls-key
- {{ printf "%s/tls.key" .Values.tls.mountPath }}
- --tls-ca
- {{ printf "%s/ca.crt" .Values.tls.mountPath }}
{{- end }}
{{- end }}

{{- define "moesplit.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled (a Secret with tls.crt, tls.key, ca.crt)" .Values.tls.secretName }}
    defaultMode: 0400
{{- end }}
{{- end }}

{{- define "moesplit.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Node Feature Discovery CPU labels required by experts.kernelIsa. */}}
{{- define "moesplit.cpuFeatureLabels" -}}
{{- $isa := .Values.experts.kernelIsa }}
{{- if eq $isa "amx" }}
{{- list "AMXBF16" "AVX512BF16" "AVX512F" | toJson }}
{{- else if eq $isa "avx512" }}
{{- list "AVX512F" | toJson }}
{{- else if eq $isa "avx2" }}
{{- list "AVX2" | toJson }}
{{- else if eq $isa "auto" }}
{{- list | toJson }}
{{- else }}
{{- fail (printf "experts.kernelIsa must be amx, avx512, avx2 or auto, not %q" $isa) }}
{{- end }}
{{- end }}

{{/* securityContext of a pod / a container (values podSecurityContext / containerSecurityContext). */}}
{{- define "moesplit.podSecurityContext" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "moesplit.containerSecurityContext" -}}
{{- with .Values.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The API key from apiKey.secretName as MOESPLIT_API_KEY (an env entry; empty without a Secret). */}}
{{- define "moesplit.apiKeyEnv" -}}
{{- if .Values.apiKey.secretName }}
- name: MOESPLIT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.key }}
{{- end }}
{{- end }}

{{/* The shard token from shardAuth.secretName as MOESPLIT_SHARD_TOKEN (an env entry, for both the expert and the
GPU pods; empty while shardAuth.enabled is false). */}}
{{- define "moesplit.shardTokenEnv" -}}
{{- if .Values.shardAuth.enabled }}
{{- if not .Values.shardAuth.secretName }}
{{- fail "shardAuth.secretName is required when shardAuth.enabled is true: create a Secret holding the token (kubectl create secret generic moesplit-shard-token --from-literal=shard-token=$(openssl rand -hex 32)) and set shardAuth.secretName to its name" }}
{{- end }}
- name: MOESPLIT_SHARD_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.shardAuth.secretName }}
      key: {{ .Values.shardAuth.key }}
{{- end }}
{{- end }}
