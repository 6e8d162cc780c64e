{{/*
Chart name, truncated to the 63 characters a label value may have.
*/}}
{{- define "gpumem-exporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name: "<release>-<chart>" unless the release name already contains the chart
name. Truncated to 63 characters (DNS label limit).
*/}}
{{- define "gpumem-exporter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpumem-exporter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels every object carries.
*/}}
{{- define "gpumem-exporter.labels" -}}
helm.sh/chart: {{ include "gpumem-exporter.chart" . }}
{{ include "gpumem-exporter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpumem-exporter
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels that select the node daemon's pods; never change them on upgrade (DaemonSet selectors
are immutable).
*/}}
{{- define "gpumem-exporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpumem-exporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpumem-exporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpumem-exporter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpumem-exporter.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding the admin token, or "" when admin routes stay off.
*/}}
{{- define "gpumem-exporter.adminTokenSecretName" -}}
{{- if and .Values.adminToken.existingSecret .Values.adminToken.value }}
{{- fail "adminToken: set either value or existingSecret, not both" }}
{{- end }}
{{- if .Values.adminToken.existingSecret }}
{{- .Values.adminToken.existingSecret }}
{{- else if .Values.adminToken.value }}
{{- printf "%s-admin-token" (include "gpumem-exporter.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
GPUMEM_LABELS: "k=v,k2=v2" from daemonset.labels, in key order.
*/}}
{{- define "gpumem-exporter.constLabels" -}}
{{- $pairs := list }}
{{- range $key, $value := .Values.daemonset.labels }}
{{- $pairs = append $pairs (printf "%s=%v" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
Namespace of an optional object: its own override, else the release namespace.
Usage: include "gpumem-exporter.namespace" (list . .Values.serviceMonitor.namespace)
*/}}
{{- define "gpumem-exporter.namespace" -}}
{{- $root := index . 0 }}
{{- default $root.Release.Namespace (index . 1) }}
{{- end }}

{{/*
Relabeling that keeps the scraped pod's node as a "node" label, so series from the node daemon
and from inference pods on the same machine can be joined.
*/}}
{{- define "gpumem-exporter.nodeRelabeling" -}}
- action: replace
  sourceLabels:
    - __meta_kubernetes_pod_node_name
  targetLabel: node
{{- end }}

{{/*
Labels of a ServiceMonitor, PodMonitor or PrometheusRule: the chart's own, its component (if
any), `release` from kubePrometheusStackRelease, then the object's additionalLabels, which win.
Merged as a map, so a key set twice renders once.
Usage: include "gpumem-exporter.monitoringLabels" (list . "node-daemon" .Values.serviceMonitor.additionalLabels)
*/}}
{{- define "gpumem-exporter.monitoringLabels" -}}
{{- $root := index . 0 }}
{{- $labels := include "gpumem-exporter.labels" $root | fromYaml }}
{{- with index . 1 }}
{{- $_ := set $labels "app.kubernetes.io/component" . }}
{{- end }}
{{- with $root.Values.kubePrometheusStackRelease }}
{{- $_ := set $labels "release" . }}
{{- end }}
{{- toYaml (mergeOverwrite $labels (index . 2 | default dict)) }}
{{- end }}

{{/*
The Secret holding the serving certificate: web.tls.existingSecret, else the cert-manager
Certificate's. Empty when TLS is off.
*/}}
{{- define "gpumem-exporter.tlsSecretName" -}}
{{- $tls := .Values.web.tls }}
{{- if $tls.enabled }}
{{- if and $tls.existingSecret $tls.certManager.enabled }}
{{- fail "web.tls: set either existingSecret or certManager.enabled, not both" }}
{{- else if $tls.existingSecret }}
{{- $tls.existingSecret }}
{{- else if $tls.certManager.enabled }}
{{- printf "%s-tls" (include "gpumem-exporter.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- fail "web.tls.enabled needs web.tls.existingSecret or web.tls.certManager.enabled" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"true" when the exporter gets a web config file (TLS or basic auth).
*/}}
{{- define "gpumem-exporter.webConfig" -}}
{{- if or .Values.web.tls.enabled .Values.web.basicAuth.users .Values.web.existingConfigSecret }}true{{ end }}
{{- end }}

{{/*
The Secret with the web config: the user's, or the one the chart renders.
*/}}
{{- define "gpumem-exporter.webConfigSecretName" -}}
{{- if .Values.web.existingConfigSecret }}
{{- if .Values.web.basicAuth.users }}
{{- fail "web.basicAuth.users and web.existingConfigSecret: put the users in your Secret's web.yml" }}
{{- end }}
{{- .Values.web.existingConfigSecret }}
{{- else }}
{{- printf "%s-web-config" (include "gpumem-exporter.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
"true" when the web config asks for basic auth.
*/}}
{{- define "gpumem-exporter.basicAuth" -}}
{{- if or .Values.web.basicAuth.users .Values.web.basicAuth.enabled }}true{{ end }}
{{- end }}

{{/*
The Service's DNS name: what the serving certificate names and the ServiceMonitor checks.
*/}}
{{- define "gpumem-exporter.serviceDns" -}}
{{- printf "%s.%s.svc" (include "gpumem-exporter.fullname" .) .Release.Namespace }}
{{- end }}
