"""The Helm chart without a cluster: strict lint, renders of several value sets, and real daemons
started from the config files the chart renders (so chart and daemons cannot drift apart).

helm-python-sdk embeds Helm (no binary, no cluster): ``lint`` and ``Chart.render`` run offline,
where ``.Capabilities`` lists only the built-in APIs (no monitoring.coreos.com/v1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import helm_python
    from helm_python.chart import Chart, lint
except ImportError:  # pragma: no cover - the test extra installs it
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("helm-python-sdk is not installed (pip install -e '.[test]')", allow_module_level=True)

from cachefs.config import (  # noqa: E402
    FuseConfig,
    MasterConfig,
    WorkerConfig,
    load_fuse_config,
    load_master_config,
    load_worker_config,
)
from cachefs.local import DaemonProcess  # noqa: E402
from helpers import client, payload, scrape, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "cachefs"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"

# Config fields the chart sets itself (not user values), and those it takes from Secrets (env).
MANAGED = {
    # etcd's endpoints, prefix and TLS files from etcd.*; its user and password from etcd.auth's
    # Secret (env); advertise_address is each master pod's IP (env).
    "master": {"host", "state_dir", "mounts", "tls_cert_file", "tls_key_file", "tls_ca_file",
               "etcd", "etcd_prefix", "etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user",
               "etcd_password", "advertise_address"},
    "worker": {"host", "cache_dirs", "master", "advertise_address", "mounts",
               "tls_cert_file", "tls_key_file", "tls_ca_file"},
}
FROM_SECRETS = {"cluster_token", "access_token"}
# The tokens a daemon's pod has in its environment (from the chart's generated Secrets, by default).
POD_TOKENS = {"CACHEFS_MASTER_ACCESS_TOKEN": "from-the-secret", "CACHEFS_WORKER_ACCESS_TOKEN": "from-the-secret"}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything": {
        "clusterToken": {"existingSecret": "cachefs-token", "key": "token"},
        "accessToken": {"existingSecret": "cachefs-access", "key": "access"},
        "tls": {"existingSecret": "cachefs-tls"},
        "objectStoreCredentials": {"existingSecret": "s3-creds",
                                   "env": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"}},
        "mounts": {"datasets": {"url": "s3://bucket/datasets", "read_only": True,
                                "options": {"endpoint_url": "http://s3.local:9000",
                                            "client_kwargs": {"region_name": "eu-west-1"}}}},
        "worker": {"hostNetwork": True, "antiAffinity": "hard",
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "pageStore": {"type": "pvc", "mountPath": "/cache", "quota": "50GiB",
                                 "pvc": {"storageClass": "local-nvme", "size": "60Gi"}},
                   "config": {"port": 29999, "metrics_port": 9464, "page_size": "4MiB", "readahead_pages": 16}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    },
    "fuse": {
        "fuse": {"enabled": True, "hostPath": "/mnt/data", "config": {"attr_timeout": 0.5, "threads": 32,
                                                                        "max_read": "1MiB", "allow_other": True}},
        "accessToken": {"existingSecret": "cachefs-access", "key": "access"},
        "tls": {"existingSecret": "cachefs-tls"},
        "worker": {"config": {"port": 29999, "metrics_port": 9464, "metadata_ttl": 10}},
    },
    "ha-bundled-etcd": {
        "master": {"replicas": 3, "config": {"port": 19998, "metrics_port": 9465, "election_lease_seconds": 5}},
        "etcd": {"bundled": {"enabled": True, "persistence": {"storageClass": "fast", "size": "4Gi"}}},
        "networkPolicy": {"enabled": True, "allowNamespaces": ["training", "monitoring"]},
        "fuse": {"enabled": True, "hostPath": "/mnt/data"},
    },
    "ha-existing-etcd": {
        "master": {"replicas": 2, "podDisruptionBudget": {"maxUnavailable": 1},
                   "config": {"port": 19998, "metrics_port": 9465}},
        "etcd": {"endpoints": ["https://etcd-0.infra.svc:2379", "https://etcd-1.infra.svc:2379"],
                 "prefix": "/cachefs/prod/", "tls": {"existingSecret": "etcd-client-tls"},
                 "auth": {"existingSecret": "etcd-auth"}},
        "clusterToken": {"existingSecret": "cachefs-token", "key": "token"},
        "networkPolicy": {"enabled": True},
    },
    "emptydir-no-persistence": {
        "master": {"persistence": {"enabled": False}, "config": {"port": 19998, "metrics_port": 9465}},
        "worker": {"pageStore": {"type": "emptyDir", "mountPath": "/cache", "quota": "8GiB",
                                 "emptyDir": {"medium": "Memory", "sizeLimit": "10Gi"}},
                   "podDisruptionBudget": {"enabled": False}, "antiAffinity": "soft"},
        "metrics": {"serviceMonitor": {"enabled": False}},
    },
}


def _render(values: dict[str, Any], name: str = "rel", namespace: str = "ml") -> dict[str, list[dict]]:
    """kind -> the objects of that kind the chart renders."""
    with Chart.load(str(CHART)) as chart:
        files = chart.render(values=values, name=name, namespace=namespace)
    out: dict[str, list[dict]] = {}
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.setdefault(doc["kind"], []).append(doc)
    return out


def _one(objects: dict[str, list[dict]], kind: str) -> dict:
    assert len(objects.get(kind, [])) == 1, f"expected one {kind}, got {len(objects.get(kind, []))}"
    return objects[kind][0]


def _config_files(objects: dict[str, list[dict]]) -> dict[str, str]:
    return _one(objects, "ConfigMap")["data"]


def _container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(name: str):
    report = lint(str(CHART), VALUE_SETS[name] or None, strict=True, namespace="ml")
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == [], serious


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_pass_strict_kubernetes_validation(name: str):
    """Every object against the Kubernetes API schemas (kubernetes-validate, offline, --strict:
    unknown fields fail); CRDs (the ServiceMonitor) have no built-in schema and are left out."""
    import kubernetes_validate

    checked = 0
    for kind, objects in _render(VALUE_SETS[name]).items():
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert obj["apiVersion"] == "monitoring.coreos.com/v1", f"no schema for {kind}"
                continue
            checked += 1
    assert checked >= 6


def test_several_masters_on_etcd_render_a_statefulset_pdb_and_master_list():
    objects = _render(VALUE_SETS["ha-bundled-etcd"])
    masters = [s for s in objects["StatefulSet"] if s["metadata"]["name"] == "rel-cachefs-master"][0]
    assert masters["spec"]["replicas"] == 3
    pdbs = {p["metadata"]["name"]: p for p in objects["PodDisruptionBudget"]}
    assert pdbs["rel-cachefs-master"]["spec"]["maxUnavailable"] == 1 and "rel-cachefs-etcd" in pdbs
    etcd = [s for s in objects["StatefulSet"] if s["metadata"]["name"] == "rel-cachefs-etcd"][0]
    assert etcd["spec"]["replicas"] == 3
    config = {name: tomllib.loads(text) for name, text in _config_files(objects).items()}
    assert config["master.toml"]["master"]["etcd"] == [  # TLS with the chart's certificates (etcd-tls.yaml)
        f"https://rel-cachefs-etcd-{i}.rel-cachefs-etcd-headless.ml.svc:2379" for i in range(3)]
    tls_files = {k: config["master.toml"]["master"].pop(k) for k in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file")}
    assert tls_files == {"etcd_ca_file": "/etc/cachefs/etcd-tls/ca.crt", "etcd_cert_file": "/etc/cachefs/etcd-tls/tls.crt",
                         "etcd_key_file": "/etc/cachefs/etcd-tls/tls.key"}
    masters_list = [f"rel-cachefs-master-{i}.rel-cachefs-master-headless.ml.svc:19998" for i in range(3)]
    assert config["worker.toml"]["worker"]["master"] == ",".join(masters_list)
    assert config["fuse.toml"]["client"]["master"] == ",".join(masters_list)
    env = _env(_container(masters))
    assert env["CACHEFS_MASTER_ADVERTISE_ADDRESS"]["value"] == "$(POD_IP):19998"
    # The masters' and workers' configs load as the daemons load them.
    assert load_master_config(None, environ=POD_TOKENS, flags=config["master.toml"]["master"]).etcd[0].startswith("https://")
    policies = {p["metadata"]["name"]: p for p in objects["NetworkPolicy"]}
    assert set(policies) == {"rel-cachefs-master", "rel-cachefs-worker", "rel-cachefs-etcd"}
    sources = policies["rel-cachefs-worker"]["spec"]["ingress"][0]["from"]
    assert {"kubernetes.io/metadata.name": "training"} in [s.get("namespaceSelector", {}).get("matchLabels") for s in sources]
    ports = {p["port"] for p in policies["rel-cachefs-worker"]["spec"]["ingress"][0]["ports"]}
    assert ports == {29999, 9464, 29998}  # gRPC, HTTP and the (plaintext) data port


def test_existing_etcd_with_tls_and_auth():
    objects = _render(VALUE_SETS["ha-existing-etcd"])
    assert "rel-cachefs-etcd" not in {s["metadata"]["name"] for s in objects["StatefulSet"]}
    master = tomllib.loads(_config_files(objects)["master.toml"])["master"]
    assert master["etcd_prefix"] == "/cachefs/prod/" and master["etcd_ca_file"] == "/etc/cachefs/etcd-tls/ca.crt"
    env = _env(_container([s for s in objects["StatefulSet"] if s["metadata"]["name"] == "rel-cachefs-master"][0]))
    assert env["CACHEFS_MASTER_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "etcd-auth", "key": "password"}
    assert "etcd_password" not in _config_files(objects)["master.toml"]


@pytest.mark.parametrize("values, why", [
    ({"master": {"replicas": 2, "config": {"port": 19998, "metrics_port": 9465}}}, "needs etcd"),
    ({"etcd": {"endpoints": ["http://e:2379"], "bundled": {"enabled": True}}}, "not both"),
])
def test_several_masters_without_etcd_do_not_render(values: dict, why: str):
    with pytest.raises(Exception, match=why):
        _render(values)


@pytest.mark.parametrize("values, where", [
    ({"worker": {"config": {"port": 29999, "metrics_port": 9464, "no_such_setting": 1}}}, "/worker/config"),
    ({"master": {"config": {"port": 19998, "metrics_port": 9465, "state_dir": "/x"}}}, "/master/config"),
    ({"worker": {"pageStore": {"type": "nfs", "mountPath": "/c", "quota": "1GiB"}}}, "/worker/pageStore/type"),
    ({"worker": {"config": {"port": 29999, "metrics_port": -1}}}, "/worker/config/metrics_port"),
    ({"typo": True}, "typo"),
])
def test_schema_refuses_bad_values(values: dict, where: str):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(where)):
        _render(values)
    report = lint(str(CHART), values, strict=True)
    assert any(m["severity"] >= 3 for m in report["messages"])


@pytest.mark.parametrize("daemon, cls", [("master", MasterConfig), ("worker", WorkerConfig)])
def test_schema_covers_exactly_the_daemon_settings(daemon: str, cls: type):
    """Every config field is a chart value, set by the chart, or taken from a Secret; nothing else."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = set(schema["properties"][daemon]["properties"]["config"]["properties"])
    fields = {f.name for f in dataclasses.fields(cls)}
    assert values | MANAGED[daemon] | FROM_SECRETS == fields
    assert not values & (MANAGED[daemon] | FROM_SECRETS)
    # Every documented default in values.yaml is a real field (the schema also enforces it).
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults[daemon]["config"]) <= values


def test_schema_covers_the_fuse_settings():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = set(schema["properties"]["fuse"]["properties"]["config"]["properties"])
    # metadata_ttl is the workers' (set by the chart); client is the [client] table.
    assert values | {"metadata_ttl", "client"} == {f.name for f in dataclasses.fields(FuseConfig)}


def test_fuse_daemonset_propagates_its_mount_and_loads_its_config(tmp_path: Path):
    assert "fuse.toml" not in _config_files(_render({}))  # off by default: no DaemonSet, no file
    assert len(_render({})["DaemonSet"]) == 1
    objects = _render(VALUE_SETS["fuse"])
    fuse = next(d for d in objects["DaemonSet"] if d["metadata"]["name"] == "rel-cachefs-fuse")
    spec = fuse["spec"]["template"]["spec"]
    container = _container(fuse)
    assert container["args"] == ["fuse", "/mnt/cachefs", "--config", "/etc/cachefs/config/fuse.toml"]
    assert container["securityContext"]["privileged"] is True  # Bidirectional propagation needs it
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["mount"]["mountPath"] == "/mnt/cachefs" and mounts["mount"]["mountPropagation"] == "Bidirectional"
    assert volumes["mount"]["hostPath"] == {"path": "/mnt/data", "type": "DirectoryOrCreate"}
    assert volumes["dev-fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    # The node's worker page store (its short-circuit socket), read-only, where the worker has it.
    assert mounts["page-store"]["readOnly"] is True and mounts["page-store"]["mountPath"] == "/var/cache/cachefs"
    assert volumes["page-store"]["hostPath"]["path"] == "/mnt/cachefs"
    assert _env(container)["CACHEFS_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "cachefs-access", "key": "access"}
    assert spec["nodeSelector"] == {"cachefs.io/worker": "true"}

    # The rendered fuse.toml is what `cachefs fuse --config` loads (the Secret's files stood in for).
    from tlscerts import make_pki

    pki = make_pki(tmp_path / "pki")
    text = _config_files(objects)["fuse.toml"]
    for rendered, real in (("/etc/cachefs/tls/ca.crt", pki.ca), ("/etc/cachefs/tls/tls.crt", pki.server_cert),
                           ("/etc/cachefs/tls/tls.key", pki.server_key)):
        assert rendered in text
        text = text.replace(rendered, real)
    (tmp_path / "fuse.toml").write_text(text)
    config = load_fuse_config(str(tmp_path / "fuse.toml"), environ={})
    assert config.client.master == "rel-cachefs-master.ml.svc:19998" and config.client.tls.enabled
    assert (config.attr_timeout, config.threads, config.max_read, config.metadata_ttl) == (0.5, 32, 1 << 20, 10)
    plain = _config_files(_render({"fuse": {"enabled": True, "hostPath": "/mnt/x", "config": {"threads": 8}}}))
    (tmp_path / "plain.toml").write_text(plain["fuse.toml"])
    config = load_fuse_config(str(tmp_path / "plain.toml"), environ={})
    assert config.client.master == "rel-cachefs-master.ml.svc:19998" and config.threads == 8
    assert config.metadata_ttl == 30 and config.attr_timeout <= config.metadata_ttl
    assert not config.writable  # read-only unless asked
    writable = _config_files(_render({"fuse": {"enabled": True, "hostPath": "/mnt/x", "config": {"writable": True}}}))
    (tmp_path / "writable.toml").write_text(writable["fuse.toml"])
    assert load_fuse_config(str(tmp_path / "writable.toml"), environ={}).writable


def test_defaults_render_master_and_workers():
    objects = _render({})
    sts, ds = _one(objects, "StatefulSet"), _one(objects, "DaemonSet")
    assert sts["metadata"]["name"] == "rel-cachefs-master" and sts["spec"]["replicas"] == 1
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in objects["Service"]}
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "state" and claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    master = _container(sts)
    assert master["args"] == ["master", "--config", "/etc/cachefs/config/master.toml"]
    mounts = {m["name"]: m["mountPath"] for m in master["volumeMounts"]}
    config = tomllib.loads(_config_files(objects)["master.toml"])
    assert config["master"]["state_dir"].startswith(mounts["state"] + "/")
    # Probes reach the HTTP port the daemon is configured to serve them on.
    ports = {p["name"]: p["containerPort"] for p in master["ports"]}
    assert ports == {"grpc": config["master"]["port"], "client": config["master"]["port"] + 1,
                     "http": config["master"]["metrics_port"]}
    assert master["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert master["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}

    worker = _container(ds)
    wconf = tomllib.loads(_config_files(objects)["worker.toml"])["worker"]
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"cachefs.io/worker": "true"}
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {
        "grpc": wconf["port"], "http": wconf["metrics_port"], "data": wconf["data_port"]}
    closed = _render({"worker": {"config": {"data_port": -1}}})  # the data port off: no port to declare
    closed_worker = _container(next(d for d in closed["DaemonSet"]))
    assert {p["name"] for p in closed_worker["ports"]} == {"grpc", "http"}
    assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The worker dials the master's Service on its gRPC port, and advertises its pod IP.
    service = next(s for s in objects["Service"] if s["metadata"]["name"] == "rel-cachefs-master")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert wconf["master"] == f"rel-cachefs-master.ml.svc:{grpc_port}"
    assert _env(worker)["CACHEFS_WORKER_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{wconf['port']}"
    page_store = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "page-store")
    assert page_store["hostPath"] == {"path": "/mnt/cachefs", "type": "DirectoryOrCreate"}
    assert wconf["cache_dirs"] == ["/var/cache/cachefs/pages:100GiB"]
    assert ds["spec"]["template"]["spec"]["initContainers"][0]["command"][:2] == ["chown", "10001:10001"]
    # Config changes roll the pods.
    assert re.fullmatch(r"[0-9a-f]{64}", ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    # No secrets configured: a generated cluster token (secure by default), no token in the ConfigMap.
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for w in (sts, ds) for e in _container(w).get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    # Both tokens generated by default: the daemons serve their pod addresses only with an access token.
    assert refs == {"CACHEFS_MASTER_CLUSTER_TOKEN": {"name": "rel-cachefs-cluster-token", "key": "token"},
                    "CACHEFS_WORKER_CLUSTER_TOKEN": {"name": "rel-cachefs-cluster-token", "key": "token"},
                    "CACHEFS_MASTER_ACCESS_TOKEN": {"name": "rel-cachefs-access-token", "key": "token"},
                    "CACHEFS_WORKER_ACCESS_TOKEN": {"name": "rel-cachefs-access-token", "key": "token"}}
    assert sorted(s["metadata"]["name"] for s in objects["Secret"]) == ["rel-cachefs-access-token", "rel-cachefs-cluster-token"]
    assert "token" not in _config_files(objects)["master.toml"]
    assert _one(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert "ServiceMonitor" not in objects  # "auto" and no Prometheus Operator API offline
    for workload in (sts, ds):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert _container(workload)["securityContext"]["readOnlyRootFilesystem"] is True
        assert not _container(workload)["image"].endswith(":latest")


def test_everything_renders_secrets_tls_pvc_hostnetwork_and_servicemonitor():
    objects = _render(VALUE_SETS["everything"])
    files = _config_files(objects)
    master_conf = tomllib.loads(files["master.toml"])
    assert master_conf["mounts"]["datasets"] == {
        "url": "s3://bucket/datasets", "read_only": True,
        "options": {"endpoint_url": "http://s3.local:9000", "client_kwargs": {"region_name": "eu-west-1"}}}
    assert master_conf["master"]["tls_cert_file"] == "/etc/cachefs/tls/tls.crt"
    wconf = tomllib.loads(files["worker.toml"])["worker"]
    assert wconf["page_size"] == "4MiB" and wconf["readahead_pages"] == 16
    assert wconf["cache_dirs"] == ["/cache/pages:50GiB"] and wconf["tls_ca_file"] == "/etc/cachefs/tls/ca.crt"
    assert "cachefs-token" not in json.dumps(files) and "s3-creds" not in json.dumps(files)

    for workload, daemon in ((_one(objects, "StatefulSet"), "MASTER"), (_one(objects, "DaemonSet"), "WORKER")):
        env = _env(_container(workload))
        assert env[f"CACHEFS_{daemon}_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "cachefs-token", "key": "token"}
        assert env[f"CACHEFS_{daemon}_ACCESS_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "cachefs-access", "key": "access"}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "secret"}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "cachefs-tls"
        assert {"name": "tls", "mountPath": "/etc/cachefs/tls", "readOnly": True} in \
            _container(workload)["volumeMounts"]

    pod = _one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    claim = next(v for v in pod["volumes"] if v["name"] == "page-store")["ephemeral"]["volumeClaimTemplate"]
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "60Gi"
    assert "initContainers" not in pod  # only a hostPath needs its ownership fixed
    term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"

    monitor = _one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s",
                                             "scrapeTimeout": "10s"}]
    # It selects the Services that carry an "http" port: the master's and the workers'.
    selected = [s for s in objects["Service"]
                if s["metadata"]["labels"].get("app.kubernetes.io/component") in ("master", "worker")
                and any(p["name"] == "http" for p in s["spec"]["ports"])]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {"master", "worker"}


def test_emptydir_and_no_persistence():
    objects = _render(VALUE_SETS["emptydir-no-persistence"])
    sts = _one(objects, "StatefulSet")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "state", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]
    pod = _one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "page-store")["emptyDir"] == {
        "medium": "Memory", "sizeLimit": "10Gi"}
    assert "PodDisruptionBudget" not in objects and "ServiceMonitor" not in objects
    assert "preferredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]


def test_notes_warn_without_a_cluster_token():
    with Chart.load(str(CHART)) as chart:
        notes, secured, generated = (chart.render(values=v, name="rel", namespace="ml")["cachefs/templates/NOTES.txt"]
                                     for v in ({"clusterToken": {"generate": False}}, VALUE_SETS["everything"], {}))
    assert "rel-cachefs-master.ml.svc:19998" in notes and "/status" in notes
    assert "WARNING: no clusterToken" in notes and "WARNING" not in secured
    assert "WARNING" not in generated and "Secret rel-cachefs-cluster-token" in generated


def test_tokens_are_generated_secrets_unless_named():
    """Every token Secret is the operator's (existingSecret) or generated with a random value, never a default."""
    import base64

    first, second = _render({"accessToken": {"generate": True}}), _render({"accessToken": {"generate": True}})
    tokens = [{s["metadata"]["name"]: base64.b64decode(s["data"]["token"]).decode() for s in r["Secret"]}
              for r in (first, second)]
    assert set(tokens[0]) == {"rel-cachefs-cluster-token", "rel-cachefs-access-token"}
    for name, token in tokens[0].items():
        assert re.fullmatch(r"[A-Za-z0-9]{48}", token) and token != tokens[1][name]  # random, not a default
    for secret in first["Secret"]:
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # kept on uninstall
    # ... and kept across upgrades: the template reads the installed one back (lookup; empty offline).
    template = (CHART / "templates" / "secrets.yaml").read_text()
    assert 'lookup "v1" "Secret"' in template and "randAlphaNum 48" in template
    workloads = first["DaemonSet"] + first["StatefulSet"]
    envs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for w in workloads for e in _container(w).get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert envs["CACHEFS_WORKER_ACCESS_TOKEN"] == "rel-cachefs-access-token"
    assert envs["CACHEFS_MASTER_CLUSTER_TOKEN"] == "rel-cachefs-cluster-token"
    # A named Secret is used as it is, and nothing is generated.
    assert "Secret" not in _render(VALUE_SETS["everything"])
    assert "Secret" not in _render({"clusterToken": {"generate": False}, "accessToken": {"generate": False}})


def test_network_policy_on_by_default_admits_release_and_training_pods_only():
    objects = _render({})
    policies = {p["metadata"]["name"]: p["spec"] for p in objects["NetworkPolicy"]}
    assert set(policies) == {"rel-cachefs-master", "rel-cachefs-worker"}
    worker = policies["rel-cachefs-worker"]
    assert worker["policyTypes"] == ["Ingress"] and len(worker["ingress"]) == 1
    sources = worker["ingress"][0]["from"]
    assert sources == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "cachefs", "app.kubernetes.io/instance": "rel"}}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"cachefs.io/client": "true"}}},
    ]
    assert {p["port"] for p in worker["ingress"][0]["ports"]} == {29999, 9464, 29998}
    # The master's gRPC port, its client port (port + 1: the view for training processes) and HTTP.
    assert {p["port"] for p in policies["rel-cachefs-master"]["ingress"][0]["ports"]} == {19998, 19999, 9465}
    service = next(s for s in objects["Service"] if s["metadata"]["name"] == "rel-cachefs-master")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 19998, "client": 19999, "http": 9465}
    off = _render({"master": {"config": {"port": 19998, "metrics_port": 9465, "client_port": False}}})
    off_service = next(s for s in off["Service"] if s["metadata"]["name"] == "rel-cachefs-master")
    assert {p["name"] for p in off_service["spec"]["ports"]} == {"grpc", "http"}
    assert "NetworkPolicy" not in _render({"networkPolicy": {"enabled": False}})


def test_fuse_mount_checks_permissions_by_default(tmp_path: Path):
    objects = _render({"fuse": {"enabled": True, "hostPath": "/mnt/x",
                                "config": {"allow_other": True, "gid": 4242, "umask": "027"}}})
    (tmp_path / "fuse.toml").write_text(_config_files(objects)["fuse.toml"])
    config = load_fuse_config(str(tmp_path / "fuse.toml"), environ={})
    assert config.allow_other and config.default_permissions
    assert (config.uid, config.gid, config.umask) == (-1, 4242, 0o027)
    defaults = _render({"fuse": {"enabled": True, "hostPath": "/mnt/x"}})
    (tmp_path / "defaults.toml").write_text(_config_files(defaults)["fuse.toml"])
    config = load_fuse_config(str(tmp_path / "defaults.toml"), environ={})
    assert config.allow_other and config.default_permissions and config.umask == 0o022


def test_dockerfile_is_small_pinned_and_non_root():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert froms and all(f == "${PYTHON_IMAGE}" for f in froms)
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE).group(1)
    assert base.startswith("python:3.11-slim") and "latest" not in text
    assert re.search(r"torch==\$\{TORCH_VERSION\}", text) and "ARG TORCH_VERSION=2.13.0" in text
    # torch is installed before the package (the pin keeps pip from pulling a CUDA build).
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("pip install --constraint")
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    chart_uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert users[-1].split(":")[0] == str(chart_uid)
    assert re.search(r'^ENTRYPOINT \["cachefs"\]', text, re.MULTILINE)
    assert "ADD http" not in text and "curl" not in text


# -- daemons from the rendered config files ------------------------------------------------------

def _rewrite(text: str, section: str, changes: dict[str, Any]) -> str:
    """Replace ``"key" = ...`` lines of ``[section]``; every key must already be there (the chart renders it)."""
    lines, current, seen = text.splitlines(), None, set()
    for i, line in enumerate(lines):
        header = re.match(r"^\[(.+)\]$", line.strip())
        if header:
            current = header.group(1)
            continue
        m = re.match(r'^"([^"]+)" = ', line)
        if current == section and m and m.group(1) in changes:
            lines[i] = f'"{m.group(1)}" = {json.dumps(changes[m.group(1)])}'
            seen.add(m.group(1))
    assert seen == set(changes), f"the chart no longer renders {set(changes) - seen} in [{section}]"
    return "\n".join(lines) + "\n"


def test_config_loader_refuses_unknown_keys(tmp_path: Path):
    """What makes the daemon start below a real check: a key the daemon does not know fails loading."""
    files = _config_files(_render({}))
    (tmp_path / "worker.toml").write_text(files["worker.toml"])
    as_rendered = load_worker_config(str(tmp_path / "worker.toml"), environ=POD_TOKENS)
    assert as_rendered.master == "rel-cachefs-master.ml.svc:19998"  # [worker] master = ... is kept
    assert as_rendered.cache_dirs[0].quota_bytes == 100 << 30
    for daemon, loader in (("master", load_master_config), ("worker", load_worker_config)):
        path = tmp_path / f"{daemon}.toml"
        path.write_text(files[f"{daemon}.toml"].replace(f"[{daemon}]\n", f'[{daemon}]\n"unknown_setting" = 1\n'))
        with pytest.raises(ValueError, match="unknown_setting"):
            loader(str(path), environ=POD_TOKENS)


def test_daemons_start_from_rendered_configs(tmp_path: Path):
    """The rendered master.toml / worker.toml start real daemons that work together.

    Rewritten for this machine, and only these: host -> 127.0.0.1, port and metrics_port -> 0
    (free ports), the master's state_dir and the worker's cache dir -> tmp_path (quota kept), the
    worker's master address -> the local master. The cluster token reaches both through the
    environment, as the pods' secretKeyRef env does.
    """
    store = tmp_path / "store"
    store.mkdir()
    data = payload(300_000, 7)
    (store / "a.bin").write_bytes(data)
    values = {"mounts": {"data": {"url": str(store), "read_only": True}},
              "clusterToken": {"existingSecret": "tok", "key": "token"},
              "worker": {"pageStore": {"type": "emptyDir", "mountPath": "/cache", "quota": "256MiB"},
                         "config": {"port": 29999, "metrics_port": 9464, "page_size": "64KiB",
                                    "readahead_pages": 0}}}
    objects = _render(values)
    files = _config_files(objects)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    token = "rendered-config-token"

    master_toml = tmp_path / "master.toml"
    master_toml.write_text(_rewrite(files["master.toml"], "master", {
        "host": "127.0.0.1", "port": 0, "metrics_port": 0, "state_dir": str(tmp_path / "state")}))
    master = DaemonProcess(["master", "--config", str(master_toml)],
                           env={**env, "CACHEFS_MASTER_CLUSTER_TOKEN": token}, log_path=str(tmp_path / "master.log"))
    with master:  # __enter__ starts it (60 s timeout)
        worker_conf = tomllib.loads(files["worker.toml"])["worker"]
        quota = worker_conf["cache_dirs"][0].rpartition(":")[2]
        worker_toml = tmp_path / "worker.toml"
        worker_toml.write_text(_rewrite(files["worker.toml"], "worker", {
            "host": "127.0.0.1", "port": 0, "metrics_port": 0, "master": master.address,
            "cache_dirs": [f"{tmp_path / 'cache'}:{quota}"]}))
        worker = DaemonProcess(["worker", "--config", str(worker_toml)],
                               env={**env, "CACHEFS_WORKER_CLUSTER_TOKEN": token},
                               log_path=str(tmp_path / "worker.log"))
        with worker:
            mport, wport = master.ready["metrics_port"], worker.ready["metrics_port"]
            # The worker registered (with the token) and took the mount from the master's config.
            assert wait_for(lambda: scrape(mport).get("cachefs_master_workers_live") == 1, timeout=30)
            assert wait_for(lambda: _status(wport, "/readyz") == 200, timeout=30)
            assert _status(mport, "/readyz") == 200 and _status(mport, "/healthz") == 200
            fs = client(worker.address)
            assert wait_for(lambda: _reads(fs, "data/a.bin") == data, timeout=30)
            pages = -(-len(data) // (64 << 10))  # the rendered page_size
            assert wait_for(lambda: scrape(wport)["cachefs_worker_cache_pages"] == pages, timeout=15)
            assert fs.cat_file("data/a.bin") == data  # now from the page store
            m = scrape(wport)
            assert m["cachefs_worker_cache_capacity_bytes"] == 256 << 20  # the rendered quota
            assert m["cachefs_worker_bytes_from_store_total"] >= len(data)
            assert scrape(mport)["cachefs_master_mounts"] == 1


def _reads(fs, path: str) -> bytes | None:
    try:
        return fs.cat_file(path)
    except OSError:
        return None


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_two_masters_and_a_worker_start_from_the_rendered_ha_configs(tmp_path: Path, etcd_cluster):
    """master.replicas 2 on an existing etcd: the rendered master.toml starts two masters on a real
    etcd (its endpoints rewritten to it), one leads; the rendered worker.toml (its master list
    rewritten to their addresses) registers through them; the leader's metrics say so."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "a.bin").write_bytes(payload(1000, 3))
    values = {"master": {"replicas": 2, "config": {"port": 19998, "metrics_port": 9465,
                                                   "election_lease_seconds": 3}},
              "etcd": {"endpoints": ["http://etcd-0.infra.svc:2379"], "prefix": "/cachefs/rendered/"},
              "mounts": {"data": {"url": str(store), "read_only": True}},
              "worker": {"pageStore": {"type": "emptyDir", "mountPath": "/cache", "quota": "64MiB"},
                         "config": {"port": 29999, "metrics_port": 9464}}}
    files = _config_files(_render(values))
    assert tomllib.loads(files["master.toml"])["master"]["etcd_prefix"] == "/cachefs/rendered/"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    masters = []
    try:
        for i in range(2):
            path = tmp_path / f"master{i}.toml"
            path.write_text(_rewrite(files["master.toml"], "master", {
                "host": "127.0.0.1", "port": 0, "metrics_port": 0, "state_dir": str(tmp_path / f"state{i}"),
                "etcd": etcd_cluster.endpoints}))
            masters.append(DaemonProcess(["master", "--config", str(path)], env=env,
                                         log_path=str(tmp_path / f"master{i}.log")).start())
        worker_conf = tomllib.loads(files["worker.toml"])["worker"]
        assert len(worker_conf["master"].split(",")) == 2  # the chart gave the worker both masters
        worker_toml = tmp_path / "worker.toml"
        worker_toml.write_text(_rewrite(files["worker.toml"], "worker", {
            "host": "127.0.0.1", "port": 0, "metrics_port": 0, "master": ",".join(m.address for m in masters),
            "cache_dirs": [f"{tmp_path / 'cache'}:64MiB"]}))
        with DaemonProcess(["worker", "--config", str(worker_toml)], env=env, log_path=str(tmp_path / "worker.log")):
            ports = [m.ready["metrics_port"] for m in masters]
            assert wait_for(lambda: sum(scrape(p).get("cachefs_master_leader", 0) for p in ports) == 1, timeout=30)
            assert wait_for(lambda: all(scrape(p).get("cachefs_master_workers_live") == 1 for p in ports), timeout=30)
            assert all(scrape(p)["cachefs_master_mounts"] == 1 for p in ports)
            assert all(_status(p, "/readyz") == 200 for p in ports)
    finally:
        for m in masters:
            m.stop()


def test_bundled_etcd_speaks_tls_with_the_certificates_the_chart_makes(tmp_path: Path):
    """The bundled etcd's rendered arguments and generated certificates run a real etcd that admits
    a master started from the rendered master.toml (its client certificate) and no one without one."""
    import base64
    import socket as socketlib
    import subprocess

    from cachefs.server.etcd.client import EtcdClient, EtcdSettings
    from cachefs.server.etcd.localcluster import etcd_binary

    values = {"master": {"replicas": 2, "config": {"port": 19998, "metrics_port": 9465}},
              "etcd": {"bundled": {"enabled": True, "replicas": 1}}}
    objects = _render(values)
    secrets = {s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()} for s in objects["Secret"]}
    server, client_tls = secrets["rel-cachefs-etcd-tls"], secrets["rel-cachefs-etcd-client-tls"]
    assert server["ca.crt"] == client_tls["ca.crt"] and server["tls.crt"] != client_tls["tls.crt"]
    sts = next(s for s in objects["StatefulSet"] if s["metadata"]["name"] == "rel-cachefs-etcd")
    args = _container(sts)["args"]
    assert "--client-cert-auth=true" in args and "--peer-client-cert-auth=true" in args
    assert all(a.split("=", 1)[1].startswith("https://") for a in args if "-urls=" in a and "metrics" not in a)
    master_sts = next(s for s in objects["StatefulSet"] if s["metadata"]["name"] == "rel-cachefs-master")
    volume = next(v for v in master_sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "etcd-tls")
    assert volume["secret"]["secretName"] == "rel-cachefs-etcd-client-tls"
    plain = _render({"etcd": {"bundled": {"enabled": True, "tls": False}}, "master": {"replicas": 2}})
    assert sorted(s["metadata"]["name"] for s in plain["Secret"]) == [  # no certificates
        "rel-cachefs-access-token", "rel-cachefs-cluster-token"]
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")

    tls_dir, client_dir = tmp_path / "etcd-tls", tmp_path / "client-tls"
    for directory, files in ((tls_dir, server), (client_dir, client_tls)):
        directory.mkdir()
        for name, data in files.items():
            (directory / name).write_bytes(data)
    ports = []
    for _ in range(3):
        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client_port, peer_port, metrics_port = ports
    override = {"--name": "m0", "--data-dir": str(tmp_path / "data"),
                "--listen-client-urls": f"https://127.0.0.1:{client_port}",
                "--advertise-client-urls": f"https://127.0.0.1:{client_port}",
                "--listen-peer-urls": f"https://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer_port}",
                "--initial-cluster": f"m0=https://127.0.0.1:{peer_port}",
                "--listen-metrics-urls": f"http://127.0.0.1:{metrics_port}"}
    real_args = []
    for arg in args:
        name = arg.split("=", 1)[0]
        real_args.append(f"{name}={override[name]}" if name in override else arg.replace("/etc/etcd/tls", str(tls_dir)))
    etcd = subprocess.Popen([binary, *real_args], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "etcd.log", "wb"))
    masters = []
    try:
        def healthy() -> bool:
            try:
                return _status(metrics_port, "/health") == 200
            except OSError:  # not listening yet
                return etcd.poll() is not None

        assert wait_for(healthy, timeout=30) and etcd.poll() is None, (tmp_path / "etcd.log").read_text()[-3000:]
        endpoint = f"https://127.0.0.1:{client_port}"
        # No client certificate: refused (the TLS handshake, or etcd's client-cert-auth).
        anonymous = EtcdClient(EtcdSettings((endpoint,), ca_file=str(client_dir / "ca.crt"), timeout=2))
        try:
            with pytest.raises(Exception):  # noqa: B017 - whichever way the refusal surfaces
                anonymous.put(b"/x", b"y")
        finally:
            anonymous.close()
        # A master from the rendered master.toml, with the rendered client certificate: leads.
        text = _config_files(objects)["master.toml"]
        path = tmp_path / "master.toml"
        path.write_text(_rewrite(text, "master", {
            "host": "127.0.0.1", "port": 0, "metrics_port": 0, "state_dir": str(tmp_path / "state"),
            "etcd": [endpoint], "etcd_ca_file": str(client_dir / "ca.crt"),
            "etcd_cert_file": str(client_dir / "tls.crt"), "etcd_key_file": str(client_dir / "tls.key")}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
        masters.append(DaemonProcess(["master", "--config", str(path)], env=env,
                                     log_path=str(tmp_path / "master.log")).start())
        port = masters[0].ready["metrics_port"]
        assert wait_for(lambda: scrape(port).get("cachefs_master_leader") == 1, timeout=30)
    finally:
        for m in masters:
            m.stop()
        etcd.terminate()
        try:
            etcd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            etcd.kill()
