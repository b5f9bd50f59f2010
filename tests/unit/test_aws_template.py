"""infra/aws/renderfleet-workers.yaml: cfn-lint clean (offline), one group per pool as the aws backend
needs, IAM no wider than the calls made, and user data that gives a worker every variable it needs."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from cfnlint.api import ManualArgs, lint

from dispatcher.fleet.backends import check_pools
from renderfleet.settings import PoolConfig, Settings

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "infra" / "aws" / "renderfleet-workers.yaml"
POOLS = {"baseline": "Baseline", "spot": "Spot"}  # pool -> the prefix of its resources


class _CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short forms (!Ref, !Sub ...) read as their long forms."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    if suffix == "Ref":
        return {"Ref": value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


_CfnLoader.add_multi_constructor("!", _intrinsic)


def template() -> dict[str, Any]:
    return yaml.load(TEMPLATE.read_text(), Loader=_CfnLoader)  # a SafeLoader with the short forms


def resources(kind: str) -> dict[str, dict[str, Any]]:
    return {name: r["Properties"] for name, r in template()["Resources"].items() if r["Type"] == kind}


def sub_text(value: Any) -> str:
    """The template string of a ``!Sub`` (``Fn::Sub``) value."""
    assert isinstance(value, dict) and "Fn::Sub" in value, value
    return str(value["Fn::Sub"])


def group_arn(name_template: str) -> str:
    return (
        "arn:${AWS::Partition}:autoscaling:${AWS::Region}:${AWS::AccountId}:autoScalingGroup:*:"
        f"autoScalingGroupName/{name_template}"
    )


def cfn_lint(text: str) -> list[str]:
    config = ManualArgs(include_checks=["I"], regions=["us-east-1", "eu-west-1"])
    return [str(m) for m in lint(text, config=config)]


def test_cfn_lint_finds_nothing_in_the_template() -> None:
    assert cfn_lint(TEMPLATE.read_text()) == []


def test_cfn_lint_would_catch_a_broken_template() -> None:
    text = TEMPLATE.read_text()
    wrong_type = text.replace("CapacityRebalance: true", "CapacityRebalance: sometimes")
    assert wrong_type != text and any("E3012" in m and "sometimes" in m for m in cfn_lint(wrong_type))
    misspelt = text.replace("CapacityRebalance: true", "CapacityRebalancing: true")
    assert any("CapacityRebalancing" in m for m in cfn_lint(misspelt))


def test_one_group_per_pool_on_demand_baseline_and_spot_overflow_with_capacity_rebalance() -> None:
    groups = resources("AWS::AutoScaling::AutoScalingGroup")
    assert set(groups) == {f"{p}Group" for p in POOLS.values()}
    names = {sub_text(g["AutoScalingGroupName"]) for g in groups.values()}
    assert names == {f"${{AWS::StackName}}-{pool}" for pool in POOLS}  # one group each, never shared
    for g in groups.values():
        assert "DesiredCapacity" not in g  # the autoscaler owns it: a stack update must not reset it
        assert g["NewInstancesProtectedFromScaleIn"] is False  # the worker protects itself while busy
    base = groups["BaselineGroup"]["MixedInstancesPolicy"]["InstancesDistribution"]
    assert base["OnDemandPercentageAboveBaseCapacity"] == 100
    spot = groups["SpotGroup"]
    dist = spot["MixedInstancesPolicy"]["InstancesDistribution"]
    assert spot["CapacityRebalance"] is True and spot["MinSize"] == 0
    assert dist["OnDemandBaseCapacity"] == 0 and dist["OnDemandPercentageAboveBaseCapacity"] == 0
    assert dist["SpotAllocationStrategy"] in ("price-capacity-optimized", "capacity-optimized")
    assert len(spot["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]) >= 3  # several types, fewer reclaims


def test_each_pools_workers_may_protect_instances_of_their_own_group_only() -> None:
    roles = resources("AWS::IAM::Role")
    profiles = resources("AWS::IAM::InstanceProfile")
    templates = resources("AWS::EC2::LaunchTemplate")
    groups = resources("AWS::AutoScaling::AutoScalingGroup")
    for pool, prefix in POOLS.items():
        role = roles[f"{prefix}WorkerRole"]
        statements = [s for p in role["Policies"] for s in p["PolicyDocument"]["Statement"]]
        autoscaling = [
            s
            for s in statements
            if any(
                str(a).startswith("autoscaling:") for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
            )
        ]
        assert autoscaling == [
            {
                "Effect": "Allow",
                "Action": "autoscaling:SetInstanceProtection",
                "Resource": {"Fn::Sub": group_arn(f"${{AWS::StackName}}-{pool}")},
            }
        ]
        # The group's instances carry this role: group -> launch template -> profile -> role.
        spec = groups[f"{prefix}Group"]["MixedInstancesPolicy"]["LaunchTemplate"]["LaunchTemplateSpecification"]
        assert spec["LaunchTemplateId"] == {"Ref": f"{prefix}LaunchTemplate"}
        data = templates[f"{prefix}LaunchTemplate"]["LaunchTemplateData"]
        assert data["IamInstanceProfile"]["Arn"] == {"Fn::GetAtt": [f"{prefix}InstanceProfile", "Arn"]}
        assert profiles[f"{prefix}InstanceProfile"]["Roles"] == [{"Ref": f"{prefix}WorkerRole"}]
        assert data["MetadataOptions"] == {"HttpEndpoint": "enabled", "HttpTokens": "required", "HttpPutResponseHopLimit": 2}


def test_the_store_policy_never_deletes_and_the_autoscaler_sizes_the_two_groups_only() -> None:
    policies = resources("AWS::IAM::ManagedPolicy")
    actions = {
        a
        for s in policies["WorkerStorePolicy"]["PolicyDocument"]["Statement"]
        for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert actions == {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "ssm:GetParameter"}
    statements = policies["AutoscalerPolicy"]["PolicyDocument"]["Statement"]
    by_action = {s["Action"]: s["Resource"] for s in statements}
    assert by_action["autoscaling:DescribeAutoScalingGroups"] == "*"  # takes no resource-level permission
    assert by_action["autoscaling:SetDesiredCapacity"] == [
        {"Fn::Sub": group_arn("${BaselineGroup}")},
        {"Fn::Sub": group_arn("${SpotGroup}")},
    ]
    assert not any(
        "*" in str(a) for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    )


def user_data(prefix: str) -> tuple[dict[str, str], list[str]]:
    """(the worker's environment as the script writes it, the `docker run` arguments)."""
    data = resources("AWS::EC2::LaunchTemplate")[f"{prefix}LaunchTemplate"]["LaunchTemplateData"]
    script = sub_text(data["UserData"]["Fn::Base64"])
    env = dict(re.findall(r'echo "([A-Z_]+)=(.*)"$', script, re.MULTILINE))
    run = next(line for line in script.replace("\\\n", " ").splitlines() if line.startswith("docker run"))
    return env, shlex.split(run)


@pytest.mark.parametrize("pool", list(POOLS))
def test_the_user_data_starts_a_worker_with_every_variable_it_needs(pool: str) -> None:
    env, run = user_data(POOLS[pool])
    assert {
        "RENDERFLEET_REDIS_URL",
        "RENDERFLEET_STORE",
        "RENDERFLEET_MODEL",
        "AWS_DEFAULT_REGION",
        "RENDERFLEET_AWS_AUTOSCALING_GROUP",
        "RENDERFLEET_SIGTERM_GRACE_SECONDS",
    } <= set(env)
    # Its own group, by the name the group is given: scale-in protection on, on the right group.
    group = resources("AWS::AutoScaling::AutoScalingGroup")[f"{POOLS[pool]}Group"]["AutoScalingGroupName"]
    assert env["RENDERFLEET_AWS_AUTOSCALING_GROUP"] == sub_text(group)
    assert env["AWS_DEFAULT_REGION"] == "${AWS::Region}" and env["RENDERFLEET_STORE"].startswith("s3://")
    assert "ssm get-parameter" in env["RENDERFLEET_REDIS_URL"] and "--with-decryption" in env["RENDERFLEET_REDIS_URL"]
    # Every RENDERFLEET_ variable it sets is a real setting.
    fields = {f"RENDERFLEET_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in env if k.startswith("RENDERFLEET_")} <= fields
    assert run[run.index("--pool") + 1] == pool and "--gpus" in run and "--env-file" in run
    # The image's flags: a node supervisor of every GPU of the instance (a worker each).
    assert run[run.index("--pool") - 1] == "$IMAGE" and run[run.index("--pool") + 2 :] == ["--gpus", "all"]
    # Docker's stop timeout covers the workers' grace for the batch in flight and the supervisor's 5 s after it.
    assert int(run[run.index("--stop-timeout") + 1]) > int(env["RENDERFLEET_SIGTERM_GRACE_SECONDS"]) + 5
    assert (env.get("RENDERFLEET_RECLAIM_WATCH") == "on") == (pool == "spot")


@pytest.mark.parametrize(
    ("baseline_type", "spot_gpus", "sizes", "per_node"),
    [("g5.xlarge", "1", ("1", "4", "16"), (1, 1)), ("g6.12xlarge", "4", ("4", "8", "16"), (4, 4))],
)
def test_the_pools_file_the_stack_outputs_is_one_autoscale_accepts(
    baseline_type: str, spot_gpus: str, sizes: tuple[str, str, str], per_node: tuple[int, int]
) -> None:
    value = template()["Outputs"]["PoolsFile"]["Value"]["Fn::Sub"]
    text, variables = value
    # The baseline's GPUs per node come from its instance type, the spot pool's from its parameter.
    assert variables["BaselineGpus"] == {"Fn::FindInMap": ["GpusPerInstance", {"Ref": "BaselineInstanceType"}, "Gpus"]}
    assert variables["SpotGpus"] == {"Ref": "SpotGpusPerInstance"}
    filled = (
        text.replace("${BaselineGroup}", "rf-baseline")
        .replace("${SpotGroup}", "rf-spot")
        .replace("${AWS::Region}", "eu-west-1")
        .replace("${BaselineMin}", sizes[0])
        .replace("${BaselineMax}", sizes[1])
        .replace("${SpotMax}", sizes[2])
        .replace("${BaselineGpus}", str(template()["Mappings"]["GpusPerInstance"][baseline_type]["Gpus"]))
        .replace("${SpotGpus}", spot_gpus)
    )
    assert "${" not in filled
    pools = {name: PoolConfig(**table) for name, table in tomllib.loads(filled)["pools"].items()}
    check_pools(pools, "PoolsFile")
    assert {p.autoscaling_group for p in pools.values()} == {"rf-baseline", "rf-spot"}
    assert (pools["baseline"].gpus_per_node, pools["spot"].gpus_per_node) == per_node


def test_each_pool_may_take_an_instance_type_of_several_gpus_and_says_how_many() -> None:
    params, gpus = template()["Parameters"], template()["Mappings"]["GpusPerInstance"]
    # Every type the baseline may take has its GPUs in the mapping, multi-GPU nodes among them.
    assert params["BaselineInstanceType"]["AllowedValues"] == list(gpus)
    assert gpus["g6.12xlarge"] == {"Gpus": 4} and gpus["p5.48xlarge"] == {"Gpus": 8}
    assert {1, 4, 8} <= {g["Gpus"] for g in gpus.values()}
    assert params["SpotGpusPerInstance"]["AllowedValues"] == [1, 4, 8]
    # The groups count instances and the pools GPUs: no group floor above what the autoscaler keeps.
    groups = resources("AWS::AutoScaling::AutoScalingGroup")
    assert groups["BaselineGroup"]["MinSize"] == 0 and groups["BaselineGroup"]["MaxSize"] == {"Ref": "BaselineMax"}
