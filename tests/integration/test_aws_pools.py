"""The aws backend against moto's server over HTTP: desired capacity, a busy node protected from scale-in,
and a worker with no region configured finding its instance's region in the metadata service."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import boto3
import pytest

from dispatcher.fleet.autoscale import AwsBackend
from renderfleet.settings import PoolConfig, Settings
from testing.metadata import FakeMetadata
from testing.servers import MotoServer
from worker.node.protection import InstanceProtection
from worker.node.reclaim import use_instance_region

pytestmark = pytest.mark.integration


def make_group(region: str) -> tuple[object, str]:
    """An Auto Scaling group (empty, MaxSize 3) in ``region`` of the moto server; (its client, its name)."""
    name = f"rf-spot-{uuid.uuid4().hex[:8]}"  # one moto server for the whole session
    ec2 = boto3.client("ec2", region_name=region)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={"ImageId": image, "InstanceType": "g5.xlarge"})
    client = boto3.client("autoscaling", region_name=region)
    client.create_auto_scaling_group(
        AutoScalingGroupName=name,
        MinSize=0,
        MaxSize=3,
        DesiredCapacity=0,
        LaunchTemplate={"LaunchTemplateName": name},
        AvailabilityZones=[f"{region}a"],
    )
    return client, name


@pytest.fixture
def aws_env(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ENDPOINT_URL": moto_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def asg(aws_env: None) -> tuple[object, str]:
    return make_group("us-east-1")


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
        "AutoScalingGroups"
    ][0]["Instances"][0]["InstanceId"]

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


def _protected(client: object, instance: str) -> bool:
    found = client.describe_auto_scaling_instances(InstanceIds=[instance])["AutoScalingInstances"]  # type: ignore[attr-defined]
    return bool(found[0]["ProtectedFromScaleIn"])


def test_a_worker_with_no_region_configured_uses_its_instances_region_from_imds(
    aws_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    client, group = make_group("eu-west-1")  # moto keeps regions apart: us-east-1 has no such group
    client.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=1)  # type: ignore[attr-defined]
    instance = client.describe_auto_scaling_groups(AutoScalingGroupNames=[group])[  # type: ignore[attr-defined]
        "AutoScalingGroups"
    ][0]["Instances"][0]["InstanceId"]
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))  # no region from ~/.aws/config either
    with FakeMetadata() as md:
        md.instance_ids["node-1"] = instance
        md.regions["node-1"] = "eu-west-1"
        settings = Settings(store="s3://renders/fleet", aws_autoscaling_group=group, aws_metadata_url=md.url("node-1"))
        assert use_instance_region(settings) == "eu-west-1"
        assert os.environ["AWS_DEFAULT_REGION"] == "eu-west-1"
        # The worker's own client, made as in production (no region given): it finds the group.
        InstanceProtection(group, metadata_url=md.url("node-1")).update(busy=True)
        assert _protected(client, instance)


def test_a_configured_region_is_kept_and_off_ec2_nothing_is_set(
    aws_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with FakeMetadata() as md:
        md.regions["node-1"] = "eu-west-1"
        settings = Settings(store="s3://renders/fleet", aws_metadata_url=md.url("node-1"))
        assert use_instance_region(settings) is None  # AWS_DEFAULT_REGION=us-east-1 is set: kept
        assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1" and md.requests == []
        monkeypatch.delenv("AWS_DEFAULT_REGION")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
        off_ec2 = Settings(store="s3://renders/fleet", aws_metadata_url=md.url("node-2"))  # answers 404
        assert use_instance_region(off_ec2) is None and "AWS_DEFAULT_REGION" not in os.environ
        local = Settings(store=str(tmp_path / "store"), aws_metadata_url=md.url("node-1"))
        assert use_instance_region(local) is None  # no AWS to call: IMDS never asked
        assert not any("node-1" in path for _, path in md.requests)
