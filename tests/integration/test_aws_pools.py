"""The aws backend against moto's server over HTTP: desired capacity, and a busy node protected from scale-in."""

from __future__ import annotations

import uuid

import boto3
import pytest

from dispatcher.autoscale import AwsBackend
from renderfleet.settings import PoolConfig
from testing.metadata import FakeMetadata
from testing.servers import MotoServer
from worker.protection import InstanceProtection

pytestmark = pytest.mark.integration


@pytest.fixture
def asg(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> tuple[object, str]:
    for name, value in {"AWS_ENDPOINT_URL": moto_server.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    name = f"rf-spot-{uuid.uuid4().hex[:8]}"  # one moto server for the whole session
    ec2 = boto3.client("ec2", region_name="us-east-1")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={"ImageId": image,
                                                                                 "InstanceType": "g5.xlarge"})
    client = boto3.client("autoscaling", region_name="us-east-1")
    client.create_auto_scaling_group(AutoScalingGroupName=name, MinSize=0, MaxSize=3, DesiredCapacity=0,
                                     LaunchTemplate={"LaunchTemplateName": name},
                                     AvailabilityZones=["us-east-1a"])
    return client, name


def test_the_aws_backend_sets_the_groups_desired_capacity_within_its_bounds(asg: tuple[object, str]) -> None:
    pools = {"spot": PoolConfig(kind="spot", backend="aws", autoscaling_group=asg[1], region="us-east-1", max=8)}
    backend = AwsBackend(pools)
    assert backend.size("spot") == 0
    backend.set_size("spot", 2)
    assert backend.size("spot") == 2
    backend.set_size("spot", 9)  # the group's own MaxSize (3) bounds it
    assert backend.size("spot") == 3
    backend.set_size("spot", 0)
    assert backend.size("spot") == 0


def test_a_busy_worker_protects_its_instance_from_scale_in_and_lifts_it_when_idle(asg: tuple[object, str]) -> None:
    client, group = asg
    client.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=1)  # type: ignore[attr-defined]
    instance = client.describe_auto_scaling_groups(AutoScalingGroupNames=[group])[  # type: ignore[attr-defined]
        "AutoScalingGroups"][0]["Instances"][0]["InstanceId"]

    def protected() -> bool:
        found = client.describe_auto_scaling_instances(InstanceIds=[instance])["AutoScalingInstances"]  # type: ignore[attr-defined]
        return bool(found[0]["ProtectedFromScaleIn"])

    with FakeMetadata() as md:
        md.instance_ids["node-1"] = instance
        guard = InstanceProtection(group, metadata_url=md.url("node-1"), region="us-east-1")
        guard.update(busy=True)
        assert protected()
        calls = len(md.requests)
        guard.update(busy=True)  # no change, no call
        assert len(md.requests) == calls
        guard.update(busy=False)
        assert not protected()
