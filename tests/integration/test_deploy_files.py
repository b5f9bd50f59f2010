"""The deployment files match the code: every manifest validates (KEDA's objects against KEDA's own
CRD schema, kept in infra/schemas), each overlay renders to what its pools need, no Deployment
carries the replicas its autoscaler owns, and KEDA reads an endpoint and a field the monitor
really serves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
import yaml

from dispatcher.fleet.autoscale import PublishedBackend
from dispatcher.status.status import fleet_status, publish_gpus_per_node
from dispatcher.views.http import serve
from renderfleet.embedded import RedisServerProcess
from renderfleet.settings import load_settings
from renderfleet.store import open_store
from testing import crd
from testing.fleet import REPO
from testing.kustomize import KustomizeError, build, object_id

pytestmark = pytest.mark.integration
K8S = REPO / "infra" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are meant for (KEDA 2.13+ needs 1.27+)


def documents(overlay: str = "spot") -> list[dict[str, Any]]:
    """What ``kubectl apply -k infra/k8s/overlays/OVERLAY`` applies."""
    return build(K8S / "overlays" / overlay)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def validate(doc: dict[str, Any]) -> None:
    """Against the Kubernetes schemas, or KEDA's CRD schema for KEDA's kinds: nothing is skipped."""
    if doc["apiVersion"].split("/")[0] in crd.GROUPS:
        assert crd.problems(doc) == []
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_overlays_are_baseline_keda_and_spot() -> None:
    assert OVERLAYS == ["baseline", "keda", "spot"]


def test_every_base_file_and_every_rendered_overlay_validates_against_the_kubernetes_and_keda_schemas() -> None:
    for path in sorted((K8S / "base").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in yaml.safe_load_all(path.read_text()):
                validate(doc)
    kinds = set()
    for overlay in OVERLAYS:
        for doc in documents(overlay):
            validate(doc)
            kinds.add(doc["kind"])
    assert {"ScaledObject", "TriggerAuthentication"} <= kinds  # KEDA's objects were among them


def test_the_keda_schema_refuses_an_unknown_field_a_wrong_type_and_a_missing_target() -> None:
    good = find(documents("keda"), "ScaledObject", "worker-spot")
    assert crd.problems(good) == []
    typo = {**good, "spec": {**good["spec"], "minReplicas": 0}}  # minReplicaCount misspelt
    assert any("minReplicas" in p for p in crd.problems(typo))
    wrong = {**good, "spec": {**good["spec"], "pollingInterval": "15s"}}
    assert any("pollingInterval" in p for p in crd.problems(wrong))
    untargeted = {**good, "spec": {k: v for k, v in good["spec"].items() if k != "scaleTargetRef"}}
    assert any("scaleTargetRef" in p for p in crd.problems(untargeted))
    unknown_version = {**good, "apiVersion": "keda.sh/v2"}
    assert crd.problems(unknown_version) and "no schema" in crd.problems(unknown_version)[0]


@pytest.mark.parametrize("overlay", ["baseline", "keda", "spot"])
def test_no_deployment_an_autoscaler_sizes_carries_replicas(overlay: str, tmp_path: Path) -> None:
    docs = documents(overlay)
    pools = _pools(docs, tmp_path)
    for pool in pools.values():
        assert "replicas" not in find(docs, "Deployment", str(pool.deployment))["spec"], pool.deployment


def test_each_scaled_object_falls_back_to_the_replicas_there_are() -> None:
    for so in (d for d in documents("keda") if d["kind"] == "ScaledObject"):
        assert so["spec"]["fallback"]["behavior"] == "currentReplicas" and so["spec"]["fallback"]["failureThreshold"] > 0
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["tolerance"] == behavior["scaleDown"]["tolerance"] == "0"


def test_the_keda_overlays_pools_differ_from_the_bases_in_the_backend_only() -> None:
    base = find(documents("spot"), "ConfigMap", "renderfleet-pools")["data"]["fleet.toml"]
    keda = find(documents("keda"), "ConfigMap", "renderfleet-pools")["data"]["fleet.toml"]
    assert keda == base.replace('backend = "kubernetes"', 'backend = "keda"') and keda != base
    names = {d["metadata"]["name"] for d in documents("keda")}
    assert "renderfleet-autoscaler" not in names  # KEDA sizes: the autoscaler needs no scale access


def test_every_file_in_infra_k8s_is_a_resource_or_a_patch_of_a_kustomization() -> None:
    used = set()
    for kz in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kz.read_text())
        used |= {(kz.parent / e).resolve() for e in spec.get("resources", []) if not (kz.parent / e).is_dir()}
        used |= {(kz.parent / e["path"]).resolve() for e in spec.get("patches", [])}
    files = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files == used, sorted(str(p.relative_to(K8S.resolve())) for p in files ^ used)


def test_a_patch_of_an_object_the_base_lacks_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{K8S / 'base'}]\npatches:\n  - path: p.yaml\n")
    (tmp_path / "p.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: worker-gpu, namespace: renderfleet}\n"
    )
    with pytest.raises(KustomizeError, match="worker-gpu"):
        build(tmp_path)


# CI (.ci/run) sets RENDERFLEET_REQUIRE_KUBECTL: there a missing kubectl fails this test instead of skipping it.
@pytest.mark.skipif(
    shutil.which("kubectl") is None and not os.environ.get("RENDERFLEET_REQUIRE_KUBECTL"),
    reason="kubectl (and its kustomize) not installed: see `make kubectl`",
)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: str) -> None:
    assert shutil.which("kubectl"), "kubectl is not installed, and CI requires it (`make kubectl`)"
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    real = {object_id(d): d for d in yaml.safe_load_all(out) if d}
    assert real == {object_id(d): d for d in documents(overlay)}


def _affinity_terms(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    aff = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    return aff["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_spot_overlay_puts_spot_workers_on_spot_nodes_with_time_to_hand_back_and_probes() -> None:
    docs = documents("spot")
    spot = find(docs, "Deployment", "worker-spot")["spec"]["template"]["spec"]
    terms = _affinity_terms(find(docs, "Deployment", "worker-spot"))
    assert all(e["operator"] == "In" for t in terms for e in t["matchExpressions"])  # spot capacity only
    assert {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["SPOT"]} in [
        e for t in terms for e in t["matchExpressions"]
    ]
    assert {"cloud.google.com/gke-spot", "nvidia.com/gpu"} <= {t["key"] for t in spot["tolerations"]}
    worker = spot["containers"][0]
    grace = float(_env(worker)["RENDERFLEET_SIGTERM_GRACE_SECONDS"])
    assert spot["terminationGracePeriodSeconds"] >= 120 and grace + 20 <= spot["terminationGracePeriodSeconds"]
    health = _env(worker)["RENDERFLEET_HEALTH_FILE"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert health in " ".join(worker[probe]["exec"]["command"]), probe
    # The base's settings survive the patch (lists of containers and env merge by name).
    assert worker["args"][:2] == ["--pool", "spot"] and "--metrics-port" in worker["args"]
    assert {"RENDERFLEET_POD_NAME", "RENDERFLEET_RECLAIM_WATCH"} <= set(_env(worker))
    base = find(docs, "Deployment", "worker-baseline")
    assert all(e["operator"] in ("NotIn", "DoesNotExist") for t in _affinity_terms(base) for e in t["matchExpressions"])


def test_the_baseline_overlay_keeps_every_worker_off_spot_nodes() -> None:
    docs = documents("baseline")
    for name in ("worker-baseline", "worker-spot"):
        deployment = find(docs, "Deployment", name)
        assert all(
            e["operator"] in ("NotIn", "DoesNotExist") for t in _affinity_terms(deployment) for e in t["matchExpressions"]
        )
        # The workers' grace (25 s), and the node supervisor's 5 s more before it kills a worker (spot: 4 GPUs).
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == (35 if "spot" in name else 30)


def test_workers_may_patch_their_pods_and_know_their_pod_name() -> None:
    docs = documents("spot")
    role = find(docs, "Role", "renderfleet-worker")
    assert any("pods" in r["resources"] and "patch" in r["verbs"] for r in role["rules"])
    binding = find(docs, "RoleBinding", "renderfleet-worker")
    assert binding["roleRef"]["name"] == "renderfleet-worker"
    for name in ("worker-baseline", "worker-spot"):
        pod = find(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "renderfleet"} in binding[
            "subjects"
        ]
        env = _env(pod["containers"][0])
        assert env["RENDERFLEET_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["RENDERFLEET_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        # The model cache is the node's: a worker rescheduled there loads it without S3.
        assert any(v["name"] == "cache" and "hostPath" in v for v in pod["volumes"])


def _pools(docs: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    """The pools file of the rendered ConfigMap, as the autoscaler reads it."""
    (tmp_path / "fleet.toml").write_text(find(docs, "ConfigMap", "renderfleet-pools")["data"]["fleet.toml"])
    return dict(load_settings(config=str(tmp_path / "fleet.toml")).pools)


@pytest.mark.parametrize(("overlay", "backend"), [("baseline", "kubernetes"), ("spot", "kubernetes"), ("keda", "keda")])
def test_the_pools_configmap_is_a_valid_pools_file(tmp_path: Path, overlay: str, backend: str) -> None:
    docs = documents(overlay)
    pools = _pools(docs, tmp_path)
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert pools and all(p.backend == backend and p.deployment in deployments for p in pools.values())
    if backend == "kubernetes":  # the autoscaler may scale exactly the pools' Deployments
        role = find(docs, "Role", "renderfleet-autoscaler")
        assert [r["resourceNames"] for r in role["rules"]] == [sorted(p.deployment for p in pools.values())]
        binding = find(docs, "RoleBinding", "renderfleet-autoscaler")
        monitor = find(docs, "Deployment", "monitor")["spec"]["template"]["spec"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": monitor["serviceAccountName"], "namespace": "renderfleet"}
        ]


@pytest.mark.parametrize("overlay", ["baseline", "keda", "spot"])
def test_each_pools_pods_request_its_gpus_per_node_and_run_a_node_supervisor_where_it_has_several(
    tmp_path: Path, overlay: str
) -> None:
    docs = documents(overlay)
    pools = _pools(docs, tmp_path)
    assert pools["spot"].gpus_per_node == 4 and pools["baseline"].gpus_per_node == 1  # one pool of each
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d["spec"] for d in docs if d["kind"] == "ScaledObject"}
    for pool in pools.values():
        pod = find(docs, "Deployment", pool.deployment)["spec"]["template"]["spec"]
        worker = pod["containers"][0]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == pool.gpus_per_node
        # Several GPUs: one supervisor, a worker per GPU the device plugin gave the pod, each with its metrics port.
        assert ("--gpus" in worker["args"]) == (pool.gpus_per_node > 1)
        if pool.gpus_per_node > 1:
            assert worker["args"][worker["args"].index("--gpus") + 1] == "all"
            port = int(worker["args"][worker["args"].index("--metrics-port") + 1])
            named = {p["name"]: p["containerPort"] for p in worker["ports"]}
            assert named == {"metrics": port, **{f"metrics-gpu{g}": port + g for g in range(1, pool.gpus_per_node)}}
        if pool.deployment in scaled:  # KEDA counts pods: the pool's max in nodes
            assert scaled[pool.deployment]["maxReplicaCount"] == pool.nodes(pool.max)
            assert scaled[pool.deployment]["minReplicaCount"] == pool.nodes(pool.min)
    assert bool(scaled) == (overlay == "keda")


def test_each_scaled_object_reads_a_field_the_monitor_serves(redis_server: RedisServerProcess, tmp_path: Path) -> None:
    docs = documents("keda")
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {"worker-spot", "worker-baseline"} <= deployments
    client = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    pools = _pools(docs, tmp_path)
    backend = PublishedBackend(client, store.url, pools)  # sizes in pods, published in GPUs (spot: 4 a pod)
    other = PublishedBackend(client, "s3://another-fleet")  # another store's pools on the same Redis
    # A monitor without the pools file: the GPUs per node the autoscaler published turn GPUs back into pods.
    publish_gpus_per_node(client, store.url, {name: p.gpus_per_node for name, p in pools.items()})
    server = serve("127.0.0.1:0", lambda: fleet_status(client, store=store), {}, "tok")
    try:
        for i, so in enumerate(scaled):
            trigger = so["spec"]["triggers"][0]
            assert trigger["type"] == "metrics-api" and trigger["metricType"] == "AverageValue"
            meta = trigger["metadata"]
            assert meta["targetValue"] == "1" and meta["authMode"] == "bearer"
            pool = meta["valueLocation"].split(".")[1]
            backend.set_size(pool, 3 + i)
            other.set_size(pool, 99)  # a pool of the same name of another store: not served here
            path = meta["url"].split(":9464", 1)[1]
            req = urllib.request.Request(
                f"http://127.0.0.1:{server.server_port}{path}", headers={"Authorization": "Bearer tok"}
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                value: Any = json.loads(resp.read())
            for part in meta["valueLocation"].split("."):
                value = value[part]
            assert value == 3 + i
    finally:
        server.shutdown()


def test_the_compose_file_parses_and_runs_the_images_the_dockerfiles_build() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    built = {"renderfleet-worker": "Dockerfile.worker", "renderfleet-dispatcher": "Dockerfile.dispatcher"}
    readme = (REPO / "docker" / "README.md").read_text()
    for image, dockerfile in built.items():
        assert (REPO / "docker" / dockerfile).exists() and f"-f docker/{dockerfile}" in readme and f"-t {image}" in readme
    ours = {name: s for name, s in services.items() if str(s["image"]).startswith("renderfleet-")}
    assert {s["image"] for s in ours.values()} == set(built)
    assert {"monitor", "worker-baseline", "worker-spot", "redis", "minio"} <= set(services)
    for s in ours.values():
        assert "${RENDERFLEET_REDIS_PASSWORD" in s["environment"]["RENDERFLEET_REDIS_URL"]
    assert "ports" not in services["redis"]  # Redis is reachable only on the compose network
    # The spot service is a node: a device list, one supervisor over what it lists.
    spot = services["worker-spot"]
    (devices,) = spot["deploy"]["resources"]["reservations"]["devices"]
    assert devices["device_ids"] and "count" not in devices and spot["command"][-2:] == ["--gpus", "all"]
    assert "--requirepass" in " ".join(services["redis"]["command"])
