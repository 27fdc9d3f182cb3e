{{/* Names and labels. */}}
{{- define "cachefs.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cachefs.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cachefs.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cachefs.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachefs.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "cachefs.labels" -}}
helm.sh/chart: {{ include "cachefs.chart" . }}
{{ include "cachefs.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "cachefs.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cachefs.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "cachefs.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* What workers and clients dial to reach the masters: the Service for one master; each master
pod's stable DNS name for several (they follow whichever answers; standbys forward to the leader). */}}
{{- define "cachefs.masterAddress" -}}
{{- $full := include "cachefs.fullname" . -}}
{{- if gt (int .Values.master.replicas) 1 -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.master.replicas) -}}
{{- $addresses = append $addresses (printf "%s-master-%d.%s-master-headless.%s.svc:%v" $full $i $full $.Release.Namespace (int $.Values.master.config.port)) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- else -}}
{{- printf "%s-master.%s.svc:%v" $full .Release.Namespace (int .Values.master.config.port) -}}
{{- end -}}
{{- end -}}

{{/* etcd for the masters: the endpoints given, or the bundled StatefulSet's members; "" for none.
Several masters without etcd cannot elect a leader: refused here. */}}
{{- define "cachefs.etcdEndpoints" -}}
{{- $full := include "cachefs.fullname" . -}}
{{- if and .Values.etcd.bundled.enabled .Values.etcd.endpoints -}}
{{- fail "etcd: set either etcd.endpoints (an existing etcd) or etcd.bundled.enabled, not both" -}}
{{- end -}}
{{- $endpoints := .Values.etcd.endpoints -}}
{{- if .Values.etcd.bundled.enabled -}}
{{- $endpoints = list -}}
{{- range $i := until (int .Values.etcd.bundled.replicas) -}}
{{- $endpoints = append $endpoints (printf "%s://%s-etcd-%d.%s-etcd-headless.%s.svc:2379" (ternary "https" "http" (not (not $.Values.etcd.bundled.tls))) $full $i $full $.Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int .Values.master.replicas) 1) (not $endpoints) -}}
{{- fail "master.replicas >= 2 needs etcd: set etcd.endpoints or etcd.bundled.enabled" -}}
{{- end -}}
{{- join "," $endpoints -}}
{{- end -}}

{{/* Config keys the chart sets for etcd (JSON; {} without etcd). */}}
{{- define "cachefs.etcdConfig" -}}
{{- $endpoints := include "cachefs.etcdEndpoints" . -}}
{{- if $endpoints -}}
{{- $config := dict "etcd" (splitList "," $endpoints) "etcd_prefix" .Values.etcd.prefix -}}
{{- if .Values.etcd.tls.existingSecret -}}
{{- $_ := set $config "etcd_ca_file" "/etc/cachefs/etcd-tls/ca.crt" -}}
{{- else if and .Values.etcd.bundled.enabled .Values.etcd.bundled.tls -}}
{{- /* the bundled etcd's CA and the masters' client certificate (etcd-tls.yaml) */ -}}
{{- $_ := set $config "etcd_ca_file" "/etc/cachefs/etcd-tls/ca.crt" -}}
{{- $_ := set $config "etcd_cert_file" "/etc/cachefs/etcd-tls/tls.crt" -}}
{{- $_ := set $config "etcd_key_file" "/etc/cachefs/etcd-tls/tls.key" -}}
{{- end -}}
{{- $config | toJson -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/*
TOML from values. "cachefs.toml.value": one value (scalar, or a list of scalars / flat maps as
inline tables); JSON strings, numbers and booleans are valid TOML. "cachefs.toml.table": a
table's scalars, then its sub-tables under [prefix."key"], recursively. Null values are left out,
so a daemon default applies.
*/}}
{{- define "cachefs.toml.value" -}}
{{- if kindIs "slice" . -}}
[{{- range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "cachefs.toml.value" $v }}{{ end -}}]
{{- else if kindIs "map" . -}}
{ {{- range $i, $k := keys . | sortAlpha }}{{ if $i }}, {{ end }}{{ $k | toJson }} = {{ include "cachefs.toml.value" (get $ $k) }}{{ end -}} }
{{- else if kindIs "float64" . -}}
{{- if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . | toJson }}{{ end -}}
{{- else -}}
{{- . | toJson -}}
{{- end -}}
{{- end -}}

{{- define "cachefs.toml.table" -}}
{{- $data := .data -}}
{{- range $k := keys $data | sortAlpha }}
{{- $v := get $data $k }}
{{- if and (not (kindIs "map" $v)) (not (kindIs "invalid" $v)) }}
{{ $k | toJson }} = {{ include "cachefs.toml.value" $v }}
{{- end }}
{{- end }}
{{- range $k := keys $data | sortAlpha }}
{{- $v := get $data $k }}
{{- if kindIs "map" $v }}
{{- $prefix := printf "%s.%s" $.prefix ($k | toJson) }}

[{{ $prefix }}]
{{- include "cachefs.toml.table" (dict "prefix" $prefix "data" $v) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Env shared by master and workers: object-store credentials from an existing Secret. */}}
{{- define "cachefs.credentialsEnv" -}}
{{- if .Values.objectStoreCredentials.existingSecret }}
{{- range $env := keys .Values.objectStoreCredentials.env | sortAlpha }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.objectStoreCredentials.existingSecret }}
      key: {{ get $.Values.objectStoreCredentials.env $env }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The cluster and access tokens as CACHEFS_<DAEMON>_*_TOKEN (never in the ConfigMap). */}}
{{- define "cachefs.tokenEnv" -}}
{{- $daemon := .daemon | upper }}
{{- $root := .root }}
{{- range $field, $name := dict "CLUSTER_TOKEN" "cluster-token" "ACCESS_TOKEN" "access-token" }}
{{- $secret := include "cachefs.tokenSecret" (dict "root" $root "name" $name) }}
{{- if $secret }}
- name: CACHEFS_{{ $daemon }}_{{ $field }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ (include "cachefs.tokenRef" (dict "root" $root "name" $name) | fromJson).key }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A token's values (clusterToken or accessToken, by "cluster-token" / "access-token"), as JSON. */}}
{{- define "cachefs.tokenRef" -}}
{{- if eq .name "cluster-token" }}{{ .root.Values.clusterToken | toJson }}{{ else }}{{ .root.Values.accessToken | toJson }}{{ end -}}
{{- end -}}

{{/* The Secret holding a token: the existing one, else the one the chart generates (secrets.yaml), else "". */}}
{{- define "cachefs.tokenSecret" -}}
{{- $ref := include "cachefs.tokenRef" . | fromJson -}}
{{- if $ref.existingSecret -}}
{{ $ref.existingSecret }}
{{- else if $ref.generate -}}
{{ include "cachefs.fullname" .root }}-{{ .name }}
{{- end -}}
{{- end -}}

{{/* Config keys the chart sets for TLS (the Secret is mounted at /etc/cachefs/tls). */}}
{{- define "cachefs.tlsConfig" -}}
{{- if .Values.tls.existingSecret -}}
{{- dict "tls_cert_file" "/etc/cachefs/tls/tls.crt" "tls_key_file" "/etc/cachefs/tls/tls.key" "tls_ca_file" "/etc/cachefs/tls/ca.crt" | toJson -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{- define "cachefs.tlsVolumeMount" -}}
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: /etc/cachefs/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "cachefs.tlsVolume" -}}
{{- if .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "cachefs.probes" -}}
livenessProbe:
  httpGet: {path: /healthz, port: http}
  {{- toYaml .livenessProbe | nindent 2 }}
readinessProbe:
  httpGet: {path: /readyz, port: http}
  {{- toYaml .readinessProbe | nindent 2 }}
{{- end -}}

{{/* A master on etcd: the address the others and the workers dial (its pod IP), etcd's user auth. */}}
{{- define "cachefs.masterEtcdEnv" -}}
{{- if include "cachefs.etcdEndpoints" . }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: CACHEFS_MASTER_ADVERTISE_ADDRESS
  value: "$(POD_IP):{{ .Values.master.config.port }}"
{{- if .Values.etcd.auth.existingSecret }}
- name: CACHEFS_MASTER_ETCD_USER
  valueFrom:
    secretKeyRef:
      name: {{ .Values.etcd.auth.existingSecret }}
      key: {{ .Values.etcd.auth.userKey }}
- name: CACHEFS_MASTER_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.etcd.auth.existingSecret }}
      key: {{ .Values.etcd.auth.passwordKey }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secret mounted at /etc/cachefs/etcd-tls in the masters: etcd.tls's, or the bundled etcd's client certificate; "" for none. */}}
{{- define "cachefs.etcdTlsSecret" -}}
{{- if .Values.etcd.tls.existingSecret -}}
{{ .Values.etcd.tls.existingSecret }}
{{- else if and .Values.etcd.bundled.enabled .Values.etcd.bundled.tls -}}
{{ include "cachefs.fullname" . }}-etcd-client-tls
{{- end -}}
{{- end -}}
