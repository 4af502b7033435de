{{- define "ztunnel.release-name" -}}
{{- .Values.resourceName | default "ztunnel" -}}
{{- end -}}

{{- define "ztunnel.labels" -}}
app.kubernetes.io/name: ztunnel
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: istio
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "ztunnel.istiod" -}}
istiod{{ if .Values.revision }}-{{ .Values.revision }}{{ end }}.{{ .Values.istioNamespace }}.svc:15012
{{- end -}}
