"""Watches for a spot reclaim notice: AWS, GCP, or a plain SIGTERM.

AWS (IMDSv2): ``PUT /latest/api/token``, then
``GET /latest/meta-data/spot/instance-action`` (404: no notice; 200: JSON with
the termination ``time``, two minutes ahead) and the rebalance recommendation
``GET /latest/meta-data/events/recommendations/rebalance`` (an early hint with
no deadline).  GCP: ``GET /computeMetadata/v1/instance/preempted`` with
``Metadata-Flavor: Google`` answers ``TRUE`` with about 30 s left.  Off the
cloud the first probe fails fast and the watcher goes quiet for that provider.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from renderfleet.settings import Settings

from worker.node.stop import StopSignal

log = logging.getLogger("renderfleet.reclaim")

GCP_WINDOW_SECONDS = 30.0
_TIMEOUT = 0.5
# Metadata addresses are always direct: never hand the IMDSv2 token (or a
# notice) to whatever HTTP(S)_PROXY the node's environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Notice(NamedTuple):
    """A reclaim notice from a probe: its kind (bounded: a metrics label), what it said, the time left."""

    kind: str  # aws: instance-action or rebalance; gcp: preemption
    reason: str
    seconds_left: float | None  # None: a hint with no deadline


def _seconds_until(stamp: str) -> float | None:
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (when - datetime.now(UTC)).total_seconds()


class AwsProbe:
    """IMDSv2 spot instance-action and rebalance recommendation."""

    name = "aws"

    def __init__(self, base_url: str):
        self.base = base_url.rstrip("/")
        self._token: str | None = None

    def get(self, path: str) -> tuple[int, str]:
        """(status, body) of an IMDSv2 GET, e.g. ``/latest/meta-data/instance-id``."""
        return self._get(path)

    def _get(self, path: str) -> tuple[int, str]:
        if self._token is None:
            req = urllib.request.Request(
                f"{self.base}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
            )
            with _DIRECT.open(req, timeout=_TIMEOUT) as resp:
                self._token = resp.read().decode()
        req = urllib.request.Request(f"{self.base}{path}", headers={"X-aws-ec2-metadata-token": self._token})
        try:
            with _DIRECT.open(req, timeout=_TIMEOUT) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                self._token = None  # expired token: fetch a new one next time
            return exc.code, ""

    def poll(self) -> Notice | None:
        status, body = self._get("/latest/meta-data/spot/instance-action")
        if status == 200:
            try:
                data = json.loads(body)
            except ValueError:
                data = {}
            left = _seconds_until(str(data.get("time", "")))
            return Notice(
                "instance-action",
                f"aws spot {data.get('action', 'interruption')}",
                120.0 if left is None else max(0.0, left),
            )
        status, body = self._get("/latest/meta-data/events/recommendations/rebalance")
        if status == 200:
            return Notice("rebalance", "aws rebalance recommendation", None)
        return None


def instance_region(base_url: str) -> str | None:
    """This EC2 instance's region (``/latest/meta-data/placement/region``, IMDSv2); None off EC2,
    or when the metadata service does not answer (a pod with the hop limit at 1)."""
    try:
        status, body = AwsProbe(base_url).get("/latest/meta-data/placement/region")
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
    region = body.strip()
    return region if status == 200 and region else None


class GcpProbe:
    """GCE preemption flag."""

    name = "gcp"

    def __init__(self, base_url: str):
        self.base = base_url.rstrip("/")

    def poll(self) -> Notice | None:
        req = urllib.request.Request(
            f"{self.base}/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"}
        )
        try:
            with _DIRECT.open(req, timeout=_TIMEOUT) as resp:
                body = resp.read().decode().strip()
        except urllib.error.HTTPError:
            return None
        if body.upper() == "TRUE":
            return Notice("preemption", "gcp preemption", GCP_WINDOW_SECONDS)
        return None


class ReclaimWatcher(threading.Thread):
    """Polls each provider; on a notice sets the stop signal and calls ``on_notice``.

    ``on_heard(cloud, kind)`` is told of every notice acted on (a rebalance
    hint, then the termination notice: two), for the worker's metrics.
    """

    def __init__(
        self,
        stop: StopSignal,
        probes: list[AwsProbe | GcpProbe],
        interval: float,
        on_notice: Callable[[], None],
        on_heard: Callable[[str, str], None] | None = None,
    ):
        super().__init__(name="rf-reclaim", daemon=True)
        self.stop = stop
        self.probes = list(probes)
        self.interval = interval
        self.on_notice = on_notice
        self.on_heard = on_heard
        self._done = threading.Event()
        self._reachable: dict[str, bool] = {}

    def run(self) -> None:
        noticed = False
        while self.probes and not self._done.is_set():
            for probe in list(self.probes):
                try:
                    notice = probe.poll()
                    self._reachable[probe.name] = True
                except (urllib.error.URLError, OSError, TimeoutError) as exc:
                    if not self._reachable.get(probe.name):
                        # Never answered: not on this cloud. Stay quiet from now on.
                        log.info("no %s metadata service (%s): not watching it", probe.name, exc)
                        self.probes.remove(probe)
                    continue
                if notice is not None:
                    _, reason, seconds_left = notice
                    if noticed and seconds_left is None:
                        continue  # the same early hint again
                    if self.on_heard is not None:
                        self.on_heard(probe.name, notice.kind)
                    log.warning(
                        "reclaim notice: %s (%s s left)", reason, "?" if seconds_left is None else f"{seconds_left:.0f}"
                    )
                    self.stop.request(reason, seconds_left=seconds_left)
                    if not noticed:
                        self.on_notice()
                    noticed = True
                    if seconds_left is not None:
                        return
                    # A rebalance hint has no deadline: keep watching for the real
                    # termination notice, which tightens the deadline.
            self._done.wait(self.interval)

    def close(self) -> None:
        self._done.set()


def use_instance_region(settings: Settings) -> str | None:
    """Where this worker calls AWS (an s3:// store, or its Auto Scaling group) and no region is
    configured (AWS_DEFAULT_REGION, AWS_REGION, ~/.aws/config), the EC2 instance's own region
    from IMDSv2 becomes AWS_DEFAULT_REGION; boto3 would otherwise have none, and the store's
    fallback, us-east-1, is wrong for a bucket or a group elsewhere.  Set in the environment,
    before any client is made, so that every boto3 session of the process sees it.  None: left as is.
    """
    if not ((settings.store or "").startswith("s3://") or settings.aws_autoscaling_group):
        return None
    import boto3

    if boto3.session.Session().region_name:
        return None
    region = instance_region(settings.aws_metadata_url)
    if region is None:
        log.warning("no AWS region configured and no EC2 metadata service answers: set AWS_DEFAULT_REGION")
        return None
    os.environ["AWS_DEFAULT_REGION"] = region
    log.info("AWS region %s, from the instance's metadata", region)
    return region
