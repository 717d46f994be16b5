{{/* Name prefix of every object; 40 characters leave room for KubeRay's pod-name suffixes. */}}
{{- define "tandem.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{/* Labels of every object and pod. */}}
{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{- define "tandem.authSecret" -}}
{{ default (printf "%s-auth" (include "tandem.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "tandem.modelsClaim" -}}
{{ default (printf "%s-models" (include "tandem.fullname" .)) .Values.models.pvc.existingClaim }}
{{- end }}

{{/* The router's Redis URL; empty: sessions stay in the router's memory. */}}
{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.internal.enabled -}}
redis://{{ include "tandem.fullname" . }}-redis:6379/0
{{- else -}}
{{ .Values.redis.externalUrl }}
{{- end -}}
{{- end }}

{{/* The models volume of a pod spec (nothing when the model ships in the image). */}}
{{- define "tandem.modelsVolume" -}}
{{- if eq .Values.models.source "pvc" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "tandem.modelsClaim" . }}
    readOnly: true
{{- else if eq .Values.models.source "hostPath" -}}
- name: models
  hostPath:
    path: {{ .Values.models.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{- define "tandem.modelsMount" -}}
{{- if ne .Values.models.source "image" -}}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end }}

{{/* One pool's worker group; called with (dict "root" $ "name" "prefill" "pool" .Values.prefill). */}}
{{- define "tandem.workerGroup" -}}
{{- $root := .root }}
{{- $pool := .pool -}}
- groupName: {{ .name }}
  replicas: {{ $pool.replicas }}
  minReplicas: {{ $pool.minReplicas }}
  maxReplicas: {{ $pool.maxReplicas }}
  idleTimeoutSeconds: {{ $pool.idleTimeoutSeconds }}
  rayStartParams:
    resources: {{ printf "\"{\\\"%s\\\": 1}\"" $pool.resourceName | squote }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .name }}
    spec:
      terminationGracePeriodSeconds: 60
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
      - name: ray-worker
        image: {{ include "tandem.image" $root }}
        imagePullPolicy: {{ $root.Values.image.pullPolicy }}
        resources:
          requests:
            {{- toYaml $pool.resources.requests | nindent 12 }}
            {{- if $pool.gpus }}
            nvidia.com/gpu: {{ $pool.gpus | quote }}
            {{- end }}
          limits:
            {{- toYaml $pool.resources.limits | nindent 12 }}
            {{- if $pool.gpus }}
            nvidia.com/gpu: {{ $pool.gpus | quote }}
            {{- end }}
        {{- with include "tandem.modelsMount" $root }}
        volumeMounts:
          {{- . | nindent 8 }}
        {{- end }}
      {{- with include "tandem.modelsVolume" $root }}
      volumes:
        {{- . | nindent 6 }}
      {{- end }}
{{- end }}
