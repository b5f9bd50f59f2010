"""Scale-in protection for a worker on EC2: an Auto Scaling group never terminates a busy node.

The autoscaler sets an Auto Scaling group's desired capacity; when it shrinks
the group, AWS picks the instance to terminate.  A worker that holds a shard
protects its own instance from scale-in and lifts the protection when idle,
so the group's scale-in lands on idle nodes (the same idea as Kubernetes'
pod-deletion-cost).  Changes only: one API call per busy/idle transition.
"""

from __future__ import annotations

import logging
from typing import Any

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
            from worker.reclaim import AwsProbe

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
        self.client.set_instance_protection(InstanceIds=[instance], AutoScalingGroupName=self.group,
                                            ProtectedFromScaleIn=busy)
        self._protected = busy
        log.info("instance %s %s from scale-in", instance, "protected" if busy else "no longer protected")


def update_protection(protection: InstanceProtection, busy: bool) -> None:
    """``protection.update(busy)``, logging any failure: AWS is never fatal to a worker.

    A failed change is tried again at the next tick (``update`` records a state
    only once AWS accepted it).
    """
    try:
        protection.update(busy)
    except Exception as exc:  # botocore's errors, a network cut, throttling
        log.warning("could not %s scale-in protection: %s", "set" if busy else "lift", exc)
