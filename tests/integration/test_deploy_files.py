"""The deployment files match the code: KEDA reads an endpoint and a field the monitor really serves."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from dispatcher.autoscale import PublishedBackend
from dispatcher.http import serve
from dispatcher.status import fleet_status
from renderfleet.embedded import RedisServerProcess
from renderfleet.settings import load_settings
from testing.fleet import REPO

pytestmark = pytest.mark.integration
K8S = REPO / "infra" / "k8s"


def documents() -> list[dict[str, Any]]:
    return [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_pools_configmap_is_a_valid_pools_file(tmp_path: Path) -> None:
    cm = next(d for d in documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "renderfleet-pools")
    (tmp_path / "fleet.toml").write_text(cm["data"]["fleet.toml"])
    pools = load_settings(config=str(tmp_path / "fleet.toml")).pools
    deployments = {d["metadata"]["name"] for d in documents() if d["kind"] == "Deployment"}
    assert pools and all(p.backend == "kubernetes" and p.deployment in deployments for p in pools.values())


def test_each_scaled_object_reads_a_field_the_monitor_serves(redis_server: RedisServerProcess) -> None:
    docs = documents()
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {"worker-spot", "worker-baseline"} <= deployments
    client = redis.Redis.from_url(redis_server.url)
    backend = PublishedBackend(client)
    server = serve("127.0.0.1:0", lambda: fleet_status(client), {}, "tok")
    try:
        for i, so in enumerate(scaled):
            trigger = so["spec"]["triggers"][0]
            assert trigger["type"] == "metrics-api" and trigger["metricType"] == "AverageValue"
            meta = trigger["metadata"]
            assert meta["targetValue"] == "1" and meta["authMode"] == "bearer"
            pool = meta["valueLocation"].split(".")[1]
            backend.set_size(pool, 3 + i)
            path = meta["url"].split(":9464", 1)[1]
            req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}{path}",
                                         headers={"Authorization": "Bearer tok"})
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
    assert "--requirepass" in " ".join(services["redis"]["command"])
