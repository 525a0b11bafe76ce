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

{{/* The image, pinned: repository@digest, else repository:tag (the appVersion by default). values.schema.json
refuses a repository that carries its own tag or digest, templates/validate.yaml the tag `latest`. */}}
{{- define "grpo.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* A memory quantity in Mi, Gi or Ti (values.schema.json allows no other) as MiB, for templates/validate.yaml. */}}
{{- define "grpo.mebibytes" -}}
{{- $n := regexFind "^[0-9]+" . | int -}}
{{- $unit := trimPrefix (toString $n) . -}}
{{- if eq $unit "Ti" -}}{{ mul $n 1048576 }}{{- else if eq $unit "Gi" -}}{{ mul $n 1024 }}{{- else -}}{{ $n }}{{- end -}}
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
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: {{ .Values.scratch.homeSizeLimit }}
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
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/grpo
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

{{/* Each probe's timings: startup (readiness's period, long enough for probes.startupSeconds), liveness (slow to
fire: it restarts the container), readiness (compose's healthcheck). */}}
{{- define "grpo.probeTimings" -}}
{{- $p := .root.Values.probes -}}
{{- if eq .probe "startupProbe" -}}
periodSeconds: {{ $p.readiness.periodSeconds }}
timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
failureThreshold: {{ div (add $p.startupSeconds $p.readiness.periodSeconds -1) $p.readiness.periodSeconds }}
{{- else -}}
{{- $t := get $p (trimSuffix "Probe" .probe) -}}
periodSeconds: {{ $t.periodSeconds }}
timeoutSeconds: {{ $t.timeoutSeconds }}
failureThreshold: {{ $t.failureThreshold }}
{{- end -}}
{{- end -}}

{{/* Probes on compose's health route: startup covers the start period, then liveness and readiness. */}}
{{- define "grpo.httpProbes" -}}
{{- range $probe := list "startupProbe" "livenessProbe" "readinessProbe" }}
{{ $probe }}:
  httpGet: {path: {{ $.path }}, port: {{ $.port }}}
  {{- include "grpo.probeTimings" (dict "root" $.root "probe" $probe) | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Every container's securityContext (values: securityContext). */}}
{{- define "grpo.containerSecurity" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
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
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
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
