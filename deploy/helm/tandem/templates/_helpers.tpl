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
      # The preStop hook's drain deadline plus time for Ray to stop (lifecycle.terminationMarginSeconds).
      terminationGracePeriodSeconds: {{ add $pool.drainDeadlineSeconds $root.Values.lifecycle.terminationMarginSeconds }}
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
        lifecycle:
          preStop:
            exec:
              # Drain this pod's workers through the router's Admin API and wait for their sequences
              # to finish (docs/deploy.md, "Pod lifecycle"); KubeRay sets FQ_RAY_IP to the head Service.
              command:
              - /bin/bash
              - -c
              - >-
                exec tandem drain-worker --self --target "${FQ_RAY_IP:-{{ include "tandem.clusterName" $root }}-head-svc}:{{ $root.Values.router.port }}"
                --deadline {{ $pool.drainDeadlineSeconds }}{{ include "tandem.routerTLSClientFlags" $root }}
        {{- with include "tandem.workerEnv" $root | trim }}
        env:
          {{- . | nindent 8 }}
        {{- end }}
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
        {{- with include "tandem.workerMounts" $root | trim }}
        volumeMounts:
          {{- . | nindent 8 }}
        {{- end }}
      {{- with include "tandem.workerVolumes" $root | trim }}
      volumes:
        {{- . | nindent 6 }}
      {{- end }}
{{- end }}

{{/* The RayCluster's name. */}}
{{- define "tandem.clusterName" -}}
{{ include "tandem.fullname" . }}-{{ .Values.cluster.color }}
{{- end }}

{{/* The admin token (Admin API: status, scale, drain-worker) from the auth Secret. */}}
{{- define "tandem.adminTokenEnv" -}}
{{- if .Values.auth.enabled -}}
- name: TANDEM_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.authSecret" . }}
      key: admin-token
{{- end }}
{{- end }}

{{/* Ray's TLS between its processes (RAY_USE_TLS; ray._common.tls_utils reads these paths). */}}
{{- define "tandem.rayTLSEnv" -}}
{{- if .Values.rayTLS.enabled -}}
- name: RAY_USE_TLS
  value: "1"
- name: RAY_TLS_SERVER_CERT
  value: /etc/ray-tls/tls.crt
- name: RAY_TLS_SERVER_KEY
  value: /etc/ray-tls/tls.key
- name: RAY_TLS_CA_CERT
  value: /etc/ray-tls/ca.crt
{{- end }}
{{- end }}

{{- define "tandem.workerEnv" -}}
{{- with include "tandem.adminTokenEnv" . }}
{{ . }}
{{- end }}
{{- with include "tandem.rayTLSEnv" . }}
{{ . }}
{{- end }}
{{- end }}

{{- define "tandem.rayTLSMount" -}}
{{- if .Values.rayTLS.enabled -}}
- name: ray-tls
  mountPath: /etc/ray-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.rayTLSVolume" -}}
{{- if .Values.rayTLS.enabled -}}
- name: ray-tls
  secret:
    secretName: {{ required "rayTLS.secretName is required with rayTLS.enabled" .Values.rayTLS.secretName }}
{{- end }}
{{- end }}

{{/* The router's TLS (routerTLS): its files on every pod, the head's `tandem up` flags, and the
flags the pool pods' preStop drain connects with. */}}
{{- define "tandem.routerTLSMount" -}}
{{- if .Values.routerTLS.enabled -}}
- name: router-tls
  mountPath: /etc/tandem-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.routerTLSVolume" -}}
{{- if .Values.routerTLS.enabled -}}
- name: router-tls
  secret:
    secretName: {{ required "routerTLS.secretName is required with routerTLS.enabled" .Values.routerTLS.secretName }}
{{- end }}
{{- end }}

{{- define "tandem.routerTLSServerFlags" -}}
{{- if .Values.routerTLS.enabled -}}
{{ " " }}--tls-cert-file /etc/tandem-tls/tls.crt --tls-key-file /etc/tandem-tls/tls.key
{{- if .Values.routerTLS.requireClientCert }} --tls-client-ca-file /etc/tandem-tls/ca.crt --tls-require-client-cert{{ end }}
{{- end }}
{{- end }}

{{- define "tandem.routerTLSClientFlags" -}}
{{- if .Values.routerTLS.enabled -}}
{{ " " }}--tls-ca-file /etc/tandem-tls/ca.crt
{{- if .Values.routerTLS.requireClientCert }} --tls-cert-file /etc/tandem-tls/tls.crt --tls-key-file /etc/tandem-tls/tls.key{{ end }}
{{- with .Values.routerTLS.serverName }} --tls-server-name {{ . }}{{ end }}
{{- end }}
{{- end }}

{{/* The port the head's probes ask: the router's own, or its plaintext health port under TLS. */}}
{{- define "tandem.probePort" -}}
{{- if .Values.routerTLS.enabled }}{{ .Values.routerTLS.healthPort }}{{ else }}{{ .Values.router.port }}{{ end }}
{{- end }}

{{- define "tandem.workerMounts" -}}
{{- with include "tandem.modelsMount" . }}
{{ . }}
{{- end }}
{{- with include "tandem.rayTLSMount" . }}
{{ . }}
{{- end }}
{{- with include "tandem.routerTLSMount" . }}
{{ . }}
{{- end }}
{{- end }}

{{- define "tandem.workerVolumes" -}}
{{- with include "tandem.modelsVolume" . }}
{{ . }}
{{- end }}
{{- with include "tandem.rayTLSVolume" . }}
{{ . }}
{{- end }}
{{- with include "tandem.routerTLSVolume" . }}
{{ . }}
{{- end }}
{{- end }}
