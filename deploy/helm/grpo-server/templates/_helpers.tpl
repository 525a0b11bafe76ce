{{/* Names: short enough that <fullname>-sampler-<i> stays a valid hostname label (63). */}}
{{- define "grpo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "grpo.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "grpo.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "grpo.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "grpo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "grpo.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "grpo.labels" -}}
{{ include "grpo.selectorLabels" . }}
app.kubernetes.io/part-of: grpo-server
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "grpo.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "grpo.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "grpo.fullname" .)) -}}
{{- end -}}

{{- define "grpo.claimName" -}}
{{- .Values.runs.existingClaim | default (printf "%s-runs" (include "grpo.fullname" .)) -}}
{{- end -}}

{{/* A worker's address: <pod>.<headless service>.<namespace>.svc.<cluster domain>. */}}
{{- define "grpo.podHost" -}}
{{- $svc := printf "%s-%s" (include "grpo.fullname" .root) .role -}}
{{- printf "%s-%d.%s.%s.svc.%s" $svc (int .index) $svc .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* The server config (server.yaml): the values' `config` plus what the layout decides. */}}
{{- define "grpo.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $_ := set $c "host" "0.0.0.0" -}}
{{- $_ := set $c "port" (int .Values.ports.frontend) -}}
{{- $_ := set $c "run_dir" "/runs" -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.sampler.replicas) -}}
{{- $urls = append $urls (printf "http://%s:%d" (include "grpo.podHost" (dict "root" $ "role" "sampler" "index" $i)) (int $.Values.ports.sampler)) -}}
{{- end -}}
{{- $sampler := deepCopy (get $c "sampler" | default dict) -}}
{{- $_ := set $sampler "urls" $urls -}}
{{- $_ := set $c "sampler" $sampler -}}
{{- $learner := deepCopy (get $c "learner" | default dict) -}}
{{- $_ := set $learner "url" (printf "http://%s:%d" (include "grpo.podHost" (dict "root" . "role" "learner" "index" 0)) (int .Values.ports.learner)) -}}
{{- if and (eq (int .Values.learner.nodes) 1) (gt (int .Values.learner.gpusPerNode) 1) -}}
{{- $_ := set $learner "ranks" (int .Values.learner.gpusPerNode) -}}
{{- end -}}
{{- $_ := set $c "learner" $learner -}}
{{- toYaml $c -}}
{{- end -}}

{{/* The config's checksum on each pod: a changed config rolls the pods that read it. Only the front end reads the
list of sampler URLs, so scaling the samplers restarts it (to connect to the new list) and no worker. */}}
{{- define "grpo.podAnnotations" -}}
{{- $config := include "grpo.config" .root | fromYaml -}}
{{- if ne .role "frontend" -}}
{{- $_ := unset $config.sampler "urls" -}}
{{- end }}
checksum/config: {{ toYaml $config | sha256sum }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "grpo.volumes" -}}
- name: runs
  persistentVolumeClaim:
    claimName: {{ include "grpo.claimName" . }}
- name: config
  configMap:
    name: {{ include "grpo.fullname" . }}-config
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "grpo.volumeMounts" -}}
- name: runs
  mountPath: /runs
- name: config
  mountPath: /etc/grpo-server
  readOnly: true
- name: shm
  mountPath: /dev/shm
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The workers' secret, from the Secret into the environment (grpo_server/protocol/worker_auth.py SECRET_ENV). */}}
{{- define "grpo.workerSecretEnv" -}}
- name: GRPO_SERVER_WORKER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "grpo.secretName" . }}
      key: worker-secret
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Probes on compose's health route: startup covers the start period, then liveness and readiness. */}}
{{- define "grpo.httpProbes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  httpGet: {path: {{ .path }}, port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ div (add $p.startupSeconds $p.periodSeconds -1) $p.periodSeconds }}
livenessProbe:
  httpGet: {path: {{ .path }}, port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
readinessProbe:
  httpGet: {path: {{ .path }}, port: {{ .port }}}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
{{- end -}}

{{- define "grpo.gpuResources" -}}
{{- $r := deepCopy (.resources | default dict) -}}
{{- $requests := deepCopy ($r.requests | default dict) -}}
{{- $limits := deepCopy ($r.limits | default dict) -}}
{{- $_ := set $requests .root.Values.gpuNodes.resourceName (int .gpus) -}}
{{- $_ := set $limits .root.Values.gpuNodes.resourceName (int .gpus) -}}
{{- toYaml (dict "requests" $requests "limits" $limits) -}}
{{- end -}}

{{- define "grpo.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . }}
{{- end }}
{{- with (.nodeSelector | default dict) }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with (.tolerations | default list) }}
tolerations:
{{ toYaml . }}
{{- end }}
{{- end -}}
