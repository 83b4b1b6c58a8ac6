{{/*
Names are DNS labels: truncated at 63 characters, with no trailing dash.
*/}}
{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release-qualified name. A release name that already contains the chart name is used as is.
*/}}
{{- define "loraplane.fullname" -}}
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

{{- define "loraplane.metricsServiceName" -}}
{{- printf "%s-metrics" (include "loraplane.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplane.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Labels on every object; the component label is added by "loraplane.labels" (operator objects) or by the
template itself (the example LoRABase).
*/}}
{{- define "loraplane.commonLabels" -}}
helm.sh/chart: {{ include "loraplane.chart" . }}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplane
{{- end }}

{{- define "loraplane.labels" -}}
{{ include "loraplane.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "loraplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplane.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
repository:tag, the tag defaulting to the chart's appVersion: a release never floats on a moving tag.
Usage: include "loraplane.image" (dict "image" .Values.image "root" $)
*/}}
{{- define "loraplane.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/*
The namespaces the operator watches when it is not cluster-wide: the release namespace first, then the extras.
*/}}
{{- define "loraplane.watchedNamespaces" -}}
{{- $all := prepend .Values.watchNamespaces .Release.Namespace | uniq }}
{{- toJson $all }}
{{- end }}

{{/*
Combinations the schema cannot express; fail with a message that names the values.
*/}}
{{- define "loraplane.validateConfig" -}}
{{- if and .Values.watchAllNamespaces .Values.watchNamespaces }}
{{- fail "watchNamespaces must be empty when watchAllNamespaces is true (the operator already watches every namespace)" }}
{{- end }}
{{- end }}
