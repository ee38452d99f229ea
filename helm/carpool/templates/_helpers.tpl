{{/*
Names, labels and the pieces every Carpool pod shares: image, settings environment, secrets, volumes.
*/}}

{{- define "carpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-wide prefix; RayService names get a per-model suffix and KubeRay appends "-serve-svc", so keep
it short. */}}
{{- define "carpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 30 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "carpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Kubernetes recommended labels. Never a tenant id: only release, component and base-model slugs. */}}
{{- define "carpool.labels" -}}
helm.sh/chart: {{ include "carpool.chart" . }}
{{ include "carpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: carpool
{{- end }}

{{- define "carpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "carpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "gateway"). */}}
{{- define "carpool.componentLabels" -}}
{{ include "carpool.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "carpool.componentSelector" -}}
{{ include "carpool.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* A DNS-safe slug of a base-model name plus a hash, so two names that differ only in dropped characters
stay apart: (include "carpool.modelSlug" "HuggingFaceTB/SmolLM2-135M-Instruct"). */}}
{{- define "carpool.modelSlug" -}}
{{- $readable := regexReplaceAll "[^a-z0-9-]+" (lower .) "-" | trimAll "-" | trunc 12 | trimSuffix "-" }}
{{- printf "%s-%s" $readable (sha1sum . | trunc 6) }}
{{- end }}

{{/* The Ray Serve application name Carpool gives a base model (worker.serve.app.application_name). */}}
{{- define "carpool.serveName" -}}
{{- $readable := regexReplaceAll "[^A-Za-z0-9_.-]+" . "-" | trimAll "-" }}
{{- printf "%s-%s" $readable (sha1sum . | trunc 6) }}
{{- end }}

{{- define "carpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "carpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "carpool.settingsName" -}}
{{ include "carpool.fullname" . }}-settings
{{- end }}

{{- define "carpool.claimName" -}}
{{- default (printf "%s-data" (include "carpool.fullname" .)) .Values.storage.existingClaim }}
{{- end }}

{{/* An image reference: (dict "root" $ "image" .Values.gateway.image "default" .Values.image). */}}
{{- define "carpool.image" -}}
{{- $image := merge (deepCopy (default dict .image)) .default }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{- define "carpool.pullPolicy" -}}
{{- $image := merge (deepCopy (default dict .image)) .default }}
{{- $image.pullPolicy }}
{{- end }}

{{/* Secret-backed environment: what no ConfigMap may hold. */}}
{{- define "carpool.secretEnv" -}}
{{- $c := .Values.connections }}
- name: CARPOOL_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.databaseUrlKey }}
- name: CARPOOL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.redisUrlKey }}
- name: CARPOOL_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.secretKeyKey }}
{{- if $c.huggingfaceTokenKey }}
- name: CARPOOL_HUB_TOKEN_HUGGINGFACE
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.huggingfaceTokenKey }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.huggingfaceTokenKey }}
{{- end }}
{{- if $c.modelscopeTokenKey }}
- name: CARPOOL_HUB_TOKEN_MODELSCOPE
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.modelscopeTokenKey }}
{{- end }}
{{- if $c.s3.enabled }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ $c.s3.secretAccessKeyKey }}
{{- end }}
{{- end }}

{{/* The whole environment of a Carpool process: settings ConfigMap + secrets. */}}
{{- define "carpool.envFrom" -}}
- configMapRef:
    name: {{ include "carpool.settingsName" . }}
{{- end }}

{{- define "carpool.dataVolume" -}}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "carpool.claimName" . }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "carpool.dataMounts" -}}
- name: data
  mountPath: {{ .Values.storage.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Only the database: what `carpool migrate` and its `--check` read. */}}
{{- define "carpool.databaseEnv" -}}
- name: CARPOOL_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.connections.existingSecret }}
      key: {{ .Values.connections.databaseUrlKey }}
{{- end }}

{{/* Init container that holds a pod until the database schema is the code's (`carpool migrate --check`). */}}
{{- define "carpool.schemaCheck" -}}
{{- if .root.Values.migrations.initCheck }}
initContainers:
  - name: schema-check
    image: {{ include "carpool.image" (dict "root" .root "image" .image "default" .root.Values.image) }}
    imagePullPolicy: {{ include "carpool.pullPolicy" (dict "image" .image "default" .root.Values.image) }}
    command: ["carpool", "migrate", "--check"]
    env:
      {{- include "carpool.databaseEnv" .root | trim | nindent 6 }}
    securityContext:
      {{- toYaml .root.Values.global.containerSecurityContext | nindent 6 }}
    resources:
      {{- toYaml .root.Values.migrations.resources | nindent 6 }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every Carpool pod (not the Ray ones, whose operator owns them). */}}
{{- define "carpool.podCommon" -}}
serviceAccountName: {{ include "carpool.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.global.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Scheduling fields of a component section: nodeSelector, tolerations, affinity. */}}
{{- define "carpool.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Restart pods when the settings change. */}}
{{- define "carpool.checksumAnnotation" -}}
checksum/settings: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}

{{/* CARPOOL_BASE_MODELS: every served model as a JSON list of NAME=SOURCE. */}}
{{- define "carpool.baseModelsSetting" -}}
{{- $specs := list }}
{{- range .Values.baseModels }}
{{- $specs = append $specs (printf "%s=%s" .name .source) }}
{{- end }}
{{- toJson $specs }}
{{- end }}

{{/* A Ray pod spec: (dict "root" $ "section" .Values.workers.head "name" "ray-head" "gpus" 0). Ray writes
under $HOME and /tmp/ray, so the root filesystem stays writable here; the user is still non-root. */}}
{{- define "carpool.rayPod" -}}
{{- $root := .root }}
{{- $w := $root.Values.workers }}
{{- $resources := deepCopy .section.resources }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $resources "limits" (merge (dict $w.gpuResourceName (int .gpus)) (default dict $resources.limits)) }}
{{- $_ := set $resources "requests" (merge (dict $w.gpuResourceName (int .gpus)) (default dict $resources.requests)) }}
{{- end }}
serviceAccountName: {{ include "carpool.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- with $root.Values.global.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.global.podSecurityContext | nindent 2 }}
{{- with (include "carpool.scheduling" .section | trim) }}{{ . | nindent 0 }}{{- end }}
containers:
  - name: {{ .name }}
    image: {{ include "carpool.image" (dict "root" $root "image" $w.image "default" $w.image) }}
    imagePullPolicy: {{ $w.image.pullPolicy }}
    ports:
      {{- if eq .name "ray-head" }}
      - name: gcs-server
        containerPort: 6379
      - name: dashboard
        containerPort: 8265
      - name: client
        containerPort: 10001
      - name: serve
        containerPort: 8000
      {{- end }}
      - name: metrics
        containerPort: 8080
    envFrom:
      {{- include "carpool.envFrom" $root | trim | nindent 6 }}
    env:
      {{- include "carpool.secretEnv" $root | trim | nindent 6 }}
    {{- with .section.probes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    resources:
      {{- toYaml $resources | nindent 6 }}
    securityContext:
      {{- $security := deepCopy $root.Values.global.containerSecurityContext }}
      {{- $_ := set $security "readOnlyRootFilesystem" false }}
      {{- toYaml $security | nindent 6 }}
    volumeMounts:
      {{- include "carpool.dataMounts" $root | trim | nindent 6 }}
volumes:
  {{- include "carpool.dataVolume" $root | trim | nindent 2 }}
{{- end }}
