"""The Kubernetes backend, the start-up check of every pool's backend, and what ``/api/autoscale`` answers.

``kubernetes``: the autoscaler sets each pool's Deployment's replicas itself,
through the Deployment's ``scale`` subresource (``GET``/``PATCH
.../deployments/NAME/scale``), so the size is exactly the decision at any
size.  The alternative, ``keda`` (:class:`dispatcher.fleet.autoscale.PublishedBackend`),
publishes the decision for a KEDA ScaledObject, whose HPA ignores a change
within its 10 % tolerance (docs/pools.md): a change of at most a tenth of
the current size is never applied, so from 10 pods on a one-pod step is not.

The RBAC this needs is ``get`` and ``patch`` on ``deployments/scale`` of the
pools' Deployments by name (infra/k8s/base/rbac.yaml): it can neither read
the Deployments' pod templates nor change any other object.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dispatcher.status.status import FleetStatus
from renderfleet.errors import ConfigError, TransientError
from renderfleet.settings import PoolConfig

log = logging.getLogger("renderfleet.autoscale")

MERGE_PATCH = "application/merge-patch+json"
# (connect, read) seconds for one call to the API server: a tick must not hang on it.
API_TIMEOUT = (3, 10)


def check_pools(pools: Mapping[str, PoolConfig], where: str | Path | None) -> None:
    """Refuse, before anything is scaled, pools whose backend lacks what it needs, and two pools
    sized through one Auto Scaling group or one Deployment: each would set the other's size every
    tick, the last writer winning.  The error names both pools and the key."""
    seen: dict[tuple[str, ...], str] = {}
    for name, pool in pools.items():
        if pool.backend == "aws":
            if not pool.autoscaling_group:
                raise ConfigError(f"{where}: pools.{name}: backend 'aws' needs autoscaling_group")
            key, ident = "autoscaling_group", ("aws", pool.region or "", pool.autoscaling_group)
            what = f"Auto Scaling group {pool.autoscaling_group!r}"
        elif pool.backend in ("kubernetes", "keda"):
            if not pool.deployment:
                raise ConfigError(f"{where}: pools.{name}: backend {pool.backend!r} needs deployment")
            key, ident = "deployment", ("k8s", pool.namespace, pool.deployment)
            what = f"Deployment {pool.namespace}/{pool.deployment}"
        else:
            continue
        if ident in seen:
            other = seen[ident]
            raise ConfigError(
                f"{where}: pools.{other}.{key} and pools.{name}.{key} both name the {what}: "
                "each pool needs its own, or the two overwrite each other's size at every tick"
            )
        seen[ident] = name


class KubernetesBackend:
    """Each pool is a Deployment; the autoscaler sets its replicas through the scale subresource.

    The Deployment's ReplicaSet picks which pod goes on a scale-in: each worker
    marks its own pod with a pod-deletion-cost (worker/node/protection.py), so idle
    pods go first.  ``api`` is a ``kubernetes.client.AppsV1Api`` (or anything
    with its two scale methods); None: one from the pod's service account, or
    from ~/.kube/config outside a cluster.
    """

    def __init__(self, pools: Mapping[str, PoolConfig], api: Any = None):
        self.pools = pools
        self._api = api

    @property
    def api(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()  # `autoscale` run by hand against a cluster
            self._api = client.AppsV1Api()
        return self._api

    def _call(self, pool: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call to the API server; a refusal that will not pass by itself is a ConfigError naming
        the pool, anything else (5xx, 429, a network cut) a TransientError: `autoscale` tries again."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        cfg = self.pools[pool]
        where = f"pools.{pool}.deployment = {cfg.deployment!r} (namespace {cfg.namespace!r})"
        try:
            return getattr(self.api, method)(cfg.deployment, cfg.namespace, *args, _request_timeout=API_TIMEOUT, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                raise ConfigError(f"{where}: no such Deployment") from None
            if exc.status in (401, 403):
                raise ConfigError(
                    f"{where}: the API server refused {method} ({exc.status} {exc.reason}): the "
                    "autoscaler's service account needs get and patch on deployments/scale of "
                    "this Deployment (infra/k8s/base/rbac.yaml)"
                ) from None
            raise TransientError(f"{where}: the API server answered {method} with {exc.status} {exc.reason}") from None
        except (HTTPError, OSError) as exc:
            raise TransientError(f"{where}: the API server could not be reached ({exc})") from None

    def size(self, pool: str) -> int:
        """The Deployment's replicas: workers asked for, running or starting."""
        return int(self._call(pool, "read_namespaced_deployment_scale").spec.replicas or 0)

    def set_size(self, pool: str, n: int) -> None:
        # A merge patch of spec.replicas alone: no read-modify-write, no conflict to retry.
        self._call(pool, "patch_namespaced_deployment_scale", {"spec": {"replicas": n}}, _content_type=MERGE_PATCH)
        cfg = self.pools[pool]
        log.warning("pool %s: Deployment %s/%s replicas %d", pool, cfg.namespace, cfg.deployment, n)


def autoscale_answer(fleet: FleetStatus, pools: Mapping[str, PoolConfig] | None) -> dict[str, Any]:
    """What ``/api/autoscale`` answers: a number for every pool, always.

    A pool the autoscaler has not decided yet (it has not started, or Redis was
    emptied) holds what is up, within its ``min`` and ``max``: a reader such as
    KEDA then neither stops running workers nor wakes new ones, where no number
    at all would be a scaler error.  ``decided`` says which it is.
    ``desired`` counts pods (nodes: what KEDA sets the replicas to), ``desired_gpus`` the workers they
    carry: the autoscaler decides in GPUs and publishes them, divided here by the pool's GPUs per node
    (its config's, else the published one).
    """
    up, nodes = fleet.pool_sizes(), fleet.nodes_up()
    names = list(pools or {}) + [p for p in {**up, **fleet.desired} if p not in (pools or {})]
    out = {}
    for name in names:
        workers = up.get(name, 0)
        cfg = (pools or {}).get(name)
        per_node = cfg.gpus_per_node if cfg else fleet.gpus_per_node.get(name, 1)
        if name in fleet.desired:
            desired, decided = -(-fleet.desired[name] // per_node), True
        else:
            now = nodes.get(name, 0)
            desired, decided = (max(cfg.nodes(cfg.min), min(cfg.nodes(cfg.max), now)) if cfg else now), False
        out[name] = {
            "workers": workers,
            "nodes": nodes.get(name, 0),
            "desired": desired,
            "desired_gpus": desired * per_node,
            "gpus_per_node": per_node,
            "decided": decided,
        }
    return {"pools": out, "backlog_seconds": fleet.backlog_seconds}
