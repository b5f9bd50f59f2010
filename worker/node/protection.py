"""Scale-in protection: a busy worker's node or pod is the last one a scale-in picks.

The autoscaler decides how many workers a pool has, never which one goes:
an EC2 Auto Scaling group picks the instance to terminate, a Deployment's
ReplicaSet the pod to delete.  So each worker marks itself while it holds a
shard and lifts the mark when idle, and the platform's own choice lands on
idle workers:

* on EC2, :class:`InstanceProtection` protects the instance from its group's
  scale-in (``SetInstanceProtection``);
* in a Kubernetes pod, :class:`PodDeletionCost` sets the pod's
  ``controller.kubernetes.io/pod-deletion-cost`` annotation, busy high, idle
  low (the ReplicaSet deletes the lowest cost first), through the official
  ``kubernetes`` client.

Changes only: one API call per busy/idle transition.  A mark that fails is
logged and tried again later (:func:`update_protection`, ``worker_tick``); it
never stops the work.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from renderfleet.settings import Settings

log = logging.getLogger("renderfleet.protection")


class InstanceProtection:
    """Protects this EC2 instance from its group's scale-in while the worker is busy."""

    def __init__(self, group: str, *, metadata_url: str, region: str | None = None, client: Any = None):
        self.group = group
        self.metadata_url = metadata_url
        self.region = region
        self._client = client
        self._instance: str | None = None
        self._protected: bool | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3

            session = boto3.session.Session()
            self._client = session.client("autoscaling", region_name=self.region or session.region_name or "us-east-1")
        return self._client

    def instance_id(self) -> str | None:
        """This instance's id, from IMDSv2 (direct, never through a proxy); None off EC2."""
        if self._instance is None:
            from worker.node.reclaim import AwsProbe

            try:
                status, body = AwsProbe(self.metadata_url).get("/latest/meta-data/instance-id")
            except OSError as exc:
                log.warning("no EC2 instance id (%s): scale-in protection off", exc)
                return None
            self._instance = body.strip() if status == 200 else None
        return self._instance

    def update(self, busy: bool) -> None:
        """Protect while ``busy``, lift it when idle; calls AWS only on a change."""
        if busy == self._protected:
            return
        instance = self.instance_id()
        if instance is None:
            return
        self.client.set_instance_protection(
            InstanceIds=[instance], AutoScalingGroupName=self.group, ProtectedFromScaleIn=busy
        )
        self._protected = busy
        log.info("instance %s %s from scale-in", instance, "protected" if busy else "no longer protected")


# The pod-deletion-cost of a worker holding a shard and of an idle one.  Among
# pods alike otherwise (ready, as old), the ReplicaSet deletes the lowest first:
# idle workers (-1000), then any not yet marked (0), busy ones (1000) last.
BUSY_COST = 1000
IDLE_COST = -1000
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class PodDeletionCost:
    """Marks this worker's pod with a pod-deletion-cost: busy high, idle low.

    ``api`` is a ``kubernetes.client.CoreV1Api`` (or anything with its
    ``patch_namespaced_pod``); :meth:`in_cluster` builds one from the pod's
    service account.
    """

    def __init__(self, pod: str, namespace: str, api: Any):
        self.pod = pod
        self.namespace = namespace
        self.api = api
        self._busy: bool | None = None

    @classmethod
    def in_cluster(cls, pod: str | None, namespace: str | None) -> PodDeletionCost | None:
        """The pod's marker, or None (logged) outside a pod or without the API server's address."""
        if not pod or not namespace:
            return None
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            log.warning("pod %s/%s: no in-cluster Kubernetes config (%s): pod-deletion-cost off", namespace, pod, exc)
            return None
        return cls(pod, namespace, client.CoreV1Api())

    def update(self, busy: bool) -> None:
        """Cost high while ``busy``, low when idle; calls the API server only on a change."""
        if busy == self._busy:
            return
        cost = BUSY_COST if busy else IDLE_COST
        body = {"metadata": {"annotations": {POD_DELETION_COST: str(cost)}}}
        # A dict body would go out as a JSON patch (the client's first choice), which
        # the API server refuses for an object; a merge patch sets just this key.
        self.api.patch_namespaced_pod(
            self.pod, self.namespace, body, _content_type="application/merge-patch+json", _request_timeout=(3, 5)
        )
        self._busy = busy
        log.info("pod %s/%s: deletion cost %d (%s)", self.namespace, self.pod, cost, "busy" if busy else "idle")


class ScaleInMark(Protocol):
    def update(self, busy: bool) -> None: ...


def update_protection(mark: ScaleInMark, busy: bool) -> bool:
    """``mark.update(busy)``, logging any failure: the cloud's or the cluster's API
    is never fatal to a worker.  False when it failed.

    A failed change is tried again at a later tick (``update`` records a state
    only once the API accepted it).
    """
    try:
        mark.update(busy)
        return True
    except Exception as exc:  # botocore's or the kubernetes client's errors, a network cut, throttling
        # The kubernetes client's errors run on with the response's headers and body: the status line is enough.
        reason = " ".join(str(exc).splitlines()[:2])
        log.warning("could not %s the scale-in mark (%s): %s", "set" if busy else "lift", type(mark).__name__, reason)
        return False


def scale_in_marks(settings: Settings) -> list[ScaleInMark]:
    """How this worker tells a scale-in to spare it while busy: its EC2 instance's
    protection, its pod's deletion cost, both or neither (worker/node/protection.py)."""
    marks: list[ScaleInMark] = []
    if settings.aws_autoscaling_group:
        marks.append(InstanceProtection(settings.aws_autoscaling_group, metadata_url=settings.aws_metadata_url))
    pod = PodDeletionCost.in_cluster(settings.pod_name, settings.pod_namespace)
    if pod is not None:
        marks.append(pod)
    return marks
