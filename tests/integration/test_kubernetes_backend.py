"""The ``kubernetes`` backend through the real ``kubernetes`` client against a stand-in API server:
replicas exactly the decision at every size, within the RBAC the manifests grant; pools that
would fight over one Deployment or one Auto Scaling group refused at start; ``/api/autoscale``
answers a number for every pool before the first decision."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from dispatcher.fleet.autoscale import PublishedBackend
from dispatcher.fleet.backends import KubernetesBackend
from dispatcher.status.status import fleet_status
from dispatcher.views.http import serve
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import ConfigError, TransientError
from renderfleet.settings import PoolConfig, load_settings
from renderfleet.store import open_store
from testing.fleet import REPO, base_env, cli, wait_for
from testing.kubeapi import MERGE_PATCH, FakeKubeApi
from testing.kustomize import build

pytestmark = pytest.mark.integration


def manifests_pools(tmp_path: Path) -> dict[str, PoolConfig]:
    """The pools file of the spot overlay's ConfigMap, as the autoscaler in the cluster reads it."""
    docs = build(REPO / "infra" / "k8s" / "overlays" / "spot")
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "renderfleet-pools")
    (tmp_path / "fleet.toml").write_text(cm["data"]["fleet.toml"])
    return dict(load_settings(config=str(tmp_path / "fleet.toml")).pools)


def scale_names_granted() -> set[str]:
    """The Deployments whose scale subresource the autoscaler's Role lets it patch."""
    docs = build(REPO / "infra" / "k8s" / "overlays" / "spot")
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "renderfleet-autoscaler")
    names: set[str] = set()
    for rule in role["rules"]:
        assert rule["resources"] == ["deployments/scale"] and rule["apiGroups"] == ["apps"], rule
        assert set(rule["verbs"]) == {"get", "patch"} and rule["resourceNames"], rule
        names |= set(rule["resourceNames"])
    return names


def test_the_backend_sets_each_deployments_replicas_to_exactly_the_decision_at_every_size(tmp_path: Path) -> None:
    pools = manifests_pools(tmp_path)
    assert {p.backend for p in pools.values()} == {"kubernetes"}
    with FakeKubeApi(token="tok") as api:
        api.scalable = scale_names_granted()  # what the manifests' RBAC allows, and nothing else
        for pool in pools.values():
            api.replicas[(pool.namespace, str(pool.deployment))] = 1
        backend = KubernetesBackend(pools, api.apps())
        for name in pools:
            # Up one at a time, then down one at a time: the steps an HPA's 10 % tolerance swallows.
            for n in [*range(0, 65), *range(63, -1, -1)]:
                backend.set_size(name, n)
                assert backend.size(name) == n
        patches = [r for r in api.requests if r[0] == "PATCH"]
        assert patches and all(r[2].startswith(MERGE_PATCH) and r[1].endswith("/scale") for r in patches)


def test_a_deployment_the_role_does_not_name_or_that_does_not_exist_is_a_config_error_naming_the_pool() -> None:
    pools = {
        "spot": PoolConfig(kind="spot", backend="kubernetes", deployment="worker-gpu", max=4),
        "baseline": PoolConfig(backend="kubernetes", deployment="worker-baseline", min=1, max=2),
    }
    with FakeKubeApi(token="tok") as api:
        api.scalable = {"worker-baseline", "worker-spot"}
        api.replicas[("renderfleet", "worker-gpu")] = 1
        backend = KubernetesBackend(pools, api.apps())
        with pytest.raises(ConfigError, match=r"pools\.spot\.deployment = 'worker-gpu'.*deployments/scale"):
            backend.set_size("spot", 2)
        assert api.replicas[("renderfleet", "worker-gpu")] == 1
        with pytest.raises(ConfigError, match=r"pools\.baseline\.deployment = 'worker-baseline'.*no such Deployment"):
            backend.size("baseline")


def test_an_api_server_error_is_transient_and_the_next_call_succeeds() -> None:
    pools = {"spot": PoolConfig(kind="spot", backend="kubernetes", deployment="worker-spot", max=4)}
    with FakeKubeApi(token="tok") as api:
        api.replicas[("renderfleet", "worker-spot")] = 1
        backend = KubernetesBackend(pools, api.apps())
        api.fail_next = 1
        with pytest.raises(TransientError, match=r"pools\.spot\.deployment = 'worker-spot'.*500"):
            backend.set_size("spot", 3)
        backend.set_size("spot", 3)  # `autoscale` tries again at its next tick
        assert api.replicas[("renderfleet", "worker-spot")] == 3
    with pytest.raises(TransientError, match="could not be reached"):  # the server gone
        backend.size("spot")


@pytest.mark.parametrize(
    ("backend", "key", "value"),
    [
        ("aws", "autoscaling_group", '"rf-gpu"'),
        ("kubernetes", "deployment", '"worker-gpu"'),
        ("keda", "deployment", '"worker-gpu"'),
    ],
)
def test_autoscale_refuses_two_pools_on_one_group_naming_both_and_the_key(
    tmp_path: Path, backend: str, key: str, value: str
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'[pools.baseline]\nbackend = "{backend}"\n{key} = {value}\nmin = 1\nmax = 2\n\n'
        f'[pools.spot]\nkind = "spot"\nbackend = "{backend}"\n{key} = {value}\nmax = 8\n'
    )
    # No Redis at this address: the check comes before any connection, or any change.
    env = base_env(tmp_path, "redis://127.0.0.1:9/0", str(tmp_path / "store"))
    proc = cli(env, "autoscale", "--config", str(config), "--once", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"pools.baseline.{key} and pools.spot.{key} both name" in proc.stderr, proc.stderr


def test_two_pools_on_groups_of_the_same_name_in_two_regions_are_two_groups(tmp_path: Path) -> None:
    from dispatcher.fleet.backends import check_pools

    east = PoolConfig(backend="aws", autoscaling_group="rf", region="us-east-1")
    # In one region the name is one group: the two pools would size it in turn, and are refused...
    again = PoolConfig(backend="aws", autoscaling_group="rf", region="us-east-1")
    with pytest.raises(ConfigError, match=r"pools\.east\.autoscaling_group and pools\.again\.autoscaling_group both name"):
        check_pools({"east": east, "again": again}, "fleet.toml")
    # ...in two regions it is two groups: accepted, the region being part of which group a pool sizes.
    west = PoolConfig(backend="aws", autoscaling_group="rf", region="us-west-2")
    check_pools({"east": east, "west": west}, "fleet.toml")


def test_api_autoscale_answers_every_configured_pool_before_the_first_decision(
    redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    pools = manifests_pools(tmp_path)
    client = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    server = serve("127.0.0.1:0", lambda: fleet_status(client, store=store), {}, "tok", pools=pools)

    def answer() -> dict[str, dict[str, int]]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.server_port}/api/autoscale", headers={"Authorization": "Bearer tok"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return dict(json.loads(resp.read())["pools"])

    try:
        before = answer()
        # No workers up and nothing decided: each pool holds what is up, within its bounds.
        assert {p: (a["desired"], a["decided"]) for p, a in before.items()} == {
            name: (cfg.nodes(cfg.min), False) for name, cfg in pools.items()
        }
        PublishedBackend(client, store.url, pools).set_size("spot", 5)  # 5 pods of the manifests' 4 GPUs each
        after = answer()
        assert after["spot"]["desired"] == 5 and after["spot"]["decided"] is True
        assert (after["spot"]["desired_gpus"], after["spot"]["gpus_per_node"]) == (20, 4)
        assert after["baseline"]["decided"] is False
    finally:
        server.shutdown()


def test_autoscale_sets_a_deployments_replicas_and_rides_out_an_api_server_error(
    redis_server: RedisServerProcess, tmp_path: Path
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[pools.baseline]\nbackend = "kubernetes"\ndeployment = "worker-baseline"\nmin = 1\nmax = 4\n\n'
        '[pools.spot]\nkind = "spot"\nbackend = "kubernetes"\ndeployment = "worker-spot"\nmax = 8\n\n'
        "[autoscale]\ninterval_seconds = 0.2\ncooldown_seconds = 0\n"
    )
    with FakeKubeApi(token="tok") as api:
        api.scalable = scale_names_granted()
        api.replicas[("renderfleet", "worker-baseline")] = 3  # no backlog: one step in, to 2
        api.replicas[("renderfleet", "worker-spot")] = 0
        api.fail_next = 1  # the first call of the first tick gets a 500
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                    "users": [{"name": "fake", "user": {"token": "tok"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                }
            )
        )
        # Outside a pod: no in-cluster config, so ~/.kube/config (here KUBECONFIG), as an operator's shell.
        env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), KUBECONFIG=str(kubeconfig))
        env.pop("KUBERNETES_SERVICE_HOST", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "autoscale", "--config", str(config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        try:
            wait_for(
                lambda: api.replicas[("renderfleet", "worker-baseline")] == 2 or proc.poll() is not None,
                120,
                what="the baseline Deployment scaled to 2",
            )
            assert proc.poll() is None  # the 500 did not stop it
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert "500" in err and "trying again" in err and "Traceback" not in err, err
        assert api.replicas[("renderfleet", "worker-spot")] == 0
