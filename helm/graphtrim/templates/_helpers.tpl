{{- define "graphtrim.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "graphtrim.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "graphtrim.labels" -}}
app.kubernetes.io/name: {{ include "graphtrim.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "graphtrim.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "graphtrim.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "graphtrim.mlflowUri" -}}
{{- if .Values.connections.mlflow.trackingUri -}}
{{- .Values.connections.mlflow.trackingUri -}}
{{- else -}}
{{- printf "http://%s-mlflow:%d" (include "graphtrim.fullname" .) (int .Values.mlflow.port) -}}
{{- end -}}
{{- end -}}
