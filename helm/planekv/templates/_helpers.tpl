{{- define "planekv.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "planekv.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: include "planekv.selector" (list . "control") */}}
{{- define "planekv.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ $.Chart.Name }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "planekv.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "planekv.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "planekv.fullname" .)) -}}
{{- end -}}

{{- define "planekv.redisUrl" -}}
redis://{{ include "planekv.fullname" . }}-redis:6379/0
{{- end -}}

{{/* the environment every PlaneKV process gets: the data dir, the bearer token as a file */}}
{{- define "planekv.env" -}}
- name: PLANEKV_DATA_DIR
  value: /data
- name: PLANEKV_API_TOKEN_FILE
  value: /run/secrets/planekv/{{ .Values.auth.apiTokenKey }}
{{- end -}}

{{/* what the processes that talk to Redis (control, store) add: its address and the file holding its password */}}
{{- define "planekv.redisEnv" -}}
- name: PLANEKV_REDIS_URL
  value: {{ include "planekv.redisUrl" . | quote }}
- name: PLANEKV_REDIS_PASSWORD_FILE
  value: /run/secrets/planekv-redis/{{ .Values.auth.redisPasswordKey }}
{{- end -}}

{{- define "planekv.rayEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN_PATH
  value: /run/secrets/planekv/{{ .Values.auth.rayTokenKey }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: RAY_NODE_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* the two tokens, mounted at /run/secrets/planekv (not the Redis password: only its users mount that) */}}
{{- define "planekv.secretVolume" -}}
- name: auth
  secret:
    secretName: {{ include "planekv.secretName" . }}
    defaultMode: 0440
    items:
      - {key: {{ .Values.auth.apiTokenKey }}, path: {{ .Values.auth.apiTokenKey }}}
      - {key: {{ .Values.auth.rayTokenKey }}, path: {{ .Values.auth.rayTokenKey }}}
{{- end -}}

{{/* the Redis password alone, mounted at /run/secrets/planekv-redis in redis, control and store */}}
{{- define "planekv.redisSecretVolume" -}}
- name: redis-auth
  secret:
    secretName: {{ include "planekv.secretName" . }}
    defaultMode: 0440
    items:
      - {key: {{ .Values.auth.redisPasswordKey }}, path: {{ .Values.auth.redisPasswordKey }}}
{{- end -}}

{{- define "planekv.podSpecCommon" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
