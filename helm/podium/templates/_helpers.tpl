{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "podium.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full release name: <release> or <release>-<chart> unless the release already says it. */}}
{{- define "podium.fullname" -}}
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

{{- define "podium.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The standard app.kubernetes.io labels. */}}
{{- define "podium.labels" -}}
helm.sh/chart: {{ include "podium.chart" . }}
{{ include "podium.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: podium
{{- end }}

{{- define "podium.selectorLabels" -}}
app.kubernetes.io/name: {{ include "podium.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: include "podium.componentLabels" (list . "orchestrator"). */}}
{{- define "podium.componentLabels" -}}
{{ include "podium.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "podium.componentSelector" -}}
{{ include "podium.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "podium.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "podium.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Service account of training pods: no API access, no token mounted. */}}
{{- define "podium.podServiceAccountName" -}}
{{- printf "%s-pod" (include "podium.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "podium.tokenSecretName" -}}
{{- default (printf "%s-api-token" (include "podium.fullname" .)) .Values.apiToken.existingSecret }}
{{- end }}

{{/* The Secret (key `token`) holding the bearer token the leaderboard's /metrics requires. */}}
{{- define "podium.metricsTokenSecretName" -}}
{{- default (printf "%s-metrics-token" (include "podium.fullname" .)) .Values.metrics.token.existingSecret }}
{{- end }}

{{/* repository@digest when a digest is given, else repository:tag (tag defaults to appVersion). */}}
{{- define "podium.image" -}}
{{- $img := index . 0 }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default (index . 1).Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{- define "podium.controlPlaneImage" -}}
{{- include "podium.image" (list .Values.image.controlPlane .) }}
{{- end }}

{{/* The release's CPU build of the pod image (appVersion-cpu: CPU torch, no CUDA libraries):
image.pod's repository, the one place the -cpu tag is written. */}}
{{- define "podium.podImageCpuBuild" -}}
{{- include "podium.image" (list (merge (dict "tag" (printf "%s-cpu" .Chart.AppVersion)) .Values.image.pod) .) }}
{{- end }}

{{/* Training pods' image. Its default tag is the release's CUDA build (appVersion) where pods
may get GPUs (orchestrator.limits.maxPodGpus > 0: a CPU build there would hold the GPUs and
train on the CPU), else its CPU build (podium.podImageCpuBuild). A tag or digest given in
image.pod wins. */}}
{{- define "podium.podImage" -}}
{{- $img := .Values.image.pod }}
{{- if and (not $img.tag) (not $img.digest) (eq (int .Values.orchestrator.limits.maxPodGpus) 0) }}
{{- include "podium.podImageCpuBuild" . }}
{{- else }}
{{- include "podium.image" (list $img .) }}
{{- end }}
{{- end }}

{{/* Image of the training pods that request no GPU (PODIUM_POD_IMAGE_CPU): the release's CPU
build (podium.podImageCpuBuild) beside its default CUDA build, so a CPU pod pulls no CUDA
libraries. Empty (every pod runs podium.podImage) where image.pod names a tag or digest (the
one image you pinned) or where no pod may get a GPU (podium.podImage is the CPU build already). */}}
{{- define "podium.podImageCpu" -}}
{{- $img := .Values.image.pod }}
{{- if and (not $img.tag) (not $img.digest) (gt (int .Values.orchestrator.limits.maxPodGpus) 0) }}
{{- include "podium.podImageCpuBuild" . }}
{{- end }}
{{- end }}

{{- define "podium.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "podium.fullname" .) }}
{{- else }}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{- define "podium.leaderboardUrl" -}}
{{- printf "http://%s-leaderboard:%v" (include "podium.fullname" .) .Values.leaderboard.service.port }}
{{- end }}

{{- define "podium.checkpointClaim" -}}
{{- default (printf "%s-checkpoints" (include "podium.fullname" .)) .Values.storage.persistence.existingClaim }}
{{- end }}

{{- define "podium.gpuClaimTemplateName" -}}
{{- if .Values.pod.gpuClaimTemplate.create }}
{{- default (printf "%s-gpu" (include "podium.fullname" .)) .Values.pod.gpuClaimTemplate.name }}
{{- else }}
{{- .Values.pod.gpuClaimTemplate.name }}
{{- end }}
{{- end }}

{{/* Container security context of the chart's workloads. */}}
{{- define "podium.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* Probes of an HTTP service: /livez (process up) and /readyz (Redis reachable). */}}
{{- define "podium.httpProbes" -}}
startupProbe:
  httpGet: {path: /livez, port: http}
  periodSeconds: 2
  failureThreshold: 60
livenessProbe:
  httpGet: {path: /livez, port: http}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
{{- end }}

{{/* A resource quantity as Kubernetes writes it: a string as given, a number of bytes as an
integer (a values file's numbers are floats, which print as 6.8719476736e+10). */}}
{{- define "podium.quantity" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}
