{{/* The prefix of every object's name: the release name, with "-passthrough" unless it says so already. */}}
{{- define "passthrough.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains "passthrough" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-passthrough" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods; `component` is operator or agent. */}}
{{- define "passthrough.selectorLabels" -}}
app.kubernetes.io/name: passthrough
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "passthrough.labels" -}}
{{ include "passthrough.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "passthrough.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The agent's user name, as the API server sees its ServiceAccount token. */}}
{{- define "passthrough.agentUser" -}}
{{- printf "system:serviceaccount:%s:%s-agent" .Release.Namespace (include "passthrough.fullname" .) -}}
{{- end -}}

{{/* CEL: the node of the caller's token ("" when it names none). A token bound to a pod carries
the pod's node in request.userInfo.extra["authentication.kubernetes.io/node-name"], as the
DaemonSet's projected token does. */}}
{{- define "passthrough.callerNode" -}}
has(request.userInfo.extra) && 'authentication.kubernetes.io/node-name' in request.userInfo.extra ? request.userInfo.extra['authentication.kubernetes.io/node-name'][0] : ''
{{- end -}}

{{/* "true" where any node may serve devices through DRA: all by default (agent.devicePlugin.dra), or
those labelled passthrough.io/mode=dra (agent.devicePlugin.perNode). The DRA mounts, RBAC, webhooks
and the operator's --dra are rendered then. */}}
{{- define "passthrough.dra" -}}
{{- if and .Values.agent.devicePlugin.enabled (or .Values.agent.devicePlugin.dra .Values.agent.devicePlugin.perNode) -}}
true
{{- end -}}
{{- end -}}
