"""A node of several GPUs under one supervisor (``renderfleet worker --gpus``), on stand-in GPUs.

No GPU here: the node's GPUs are stand-ins (``RENDERFLEET_STAND_IN_GPUS``, allowed by
``RENDERFLEET_ALLOW_STAND_IN_GPUS`` as a bench model is by its switch), each worker a real
``renderfleet worker`` process on the CPU serving a bench model, one of them given a CUDA error
at the ``render`` failpoint for its GPU alone (``render@gpu2=...``).  Real Redis, the CLI as a
user runs it, moto's Auto Scaling and the fake metadata service for the node's protection and its
spot notice.  What a GPU alone can show (that ``CUDA_VISIBLE_DEVICES`` hides the other cards, a
real device error) is not shown here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from dispatcher.fleet.autoscale import LocalBackend
from renderfleet import failpoints, keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.nodes import GpuState, NodeRecord
from renderfleet.settings import PoolConfig
from testing.fleet import REPO, WorkerProc, base_env, bench, bench_worker, cli, status_now, wait_for, write_prompts
from testing.metadata import FakeMetadata
from testing.servers import MotoServer
from tests.integration.test_aws_pools import make_group
from worker.node.policy import Backoff, NodePolicy
from worker.node.supervisor import NodeSupervisor

pytestmark = pytest.mark.integration

GRACE = 3.0  # the workers' RENDERFLEET_SIGTERM_GRACE_SECONDS
WITHIN = GRACE + 5.0 + 5.0  # the grace, the supervisor's margin for the hand-back, and a loaded machine's slack
CUDA_ERROR = "render=raise(RuntimeError: CUDA error: an illegal memory access was encountered)"


def node_env(tmp_path: Path, redis_url: str, gpus: int, seconds_per_image: float, **extra: str) -> dict[str, str]:
    return base_env(
        tmp_path,
        redis_url,
        str(tmp_path / "store"),
        **bench_worker(seconds_per_image),
        RENDERFLEET_STAND_IN_GPUS=str(gpus),
        RENDERFLEET_ALLOW_STAND_IN_GPUS="1",
        RENDERFLEET_SIGTERM_GRACE_SECONDS=str(GRACE),
        **extra,
    )


def start_node(env: dict[str, str], tmp_path: Path, procs: list, *args: str) -> WorkerProc:
    node = WorkerProc(env, tmp_path / "node.log", "--gpus", "all", "--verbose", *args)
    procs.append(node)  # killed, process group and all (its workers are in it), at the end
    return node


def record(client: redis.Redis) -> NodeRecord | None:
    """The one node's record."""
    ids = [keys.text(n) for n in client.smembers(keys.NODES)]
    assert len(ids) <= 1, ids
    raw = client.get(keys.node(ids[0])) if ids else None
    return None if raw is None else NodeRecord.from_json(raw)


def states(client: redis.Redis) -> dict[str, str]:
    rec = record(client)
    return {} if rec is None else {g.gpu: str(g.state) for g in rec.gpus}


def gpu(client: redis.Redis, label: str) -> Any:
    rec = record(client)
    assert rec is not None
    return next(g for g in rec.gpus if g.gpu == label)


def registered(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """The node's workers' registrations (loaded, not loading), by GPU: the latest of each (a
    worker killed outright leaves its own behind)."""
    regs = sorted((json.loads(v) for v in client.hvals(keys.WORKERS)), key=lambda r: r.get("started", 0))
    return {r["gpu"]: r for r in regs if r.get("node") and r.get("state") != "loading"}


def all_up(client: redis.Redis, node: WorkerProc, n: int) -> None:
    def up() -> bool:
        regs = registered(client)
        pids = {g: r["pid"] for g, r in regs.items()}
        rec = record(client)
        return (
            rec is not None and all(g.state == GpuState.UP and pids.get(g.gpu) == g.pid for g in rec.gpus) and len(regs) >= n
        )

    wait_for(lambda: up() or not node.alive(), 90, what=f"{n} workers of the node to register")
    assert node.alive(), node.output()[-3000:]


def busy_gpus(client: redis.Redis) -> set[str]:
    ids = [keys.text(n) for n in client.smembers(keys.NODES)]
    marks = client.hgetall(keys.node_gpus(ids[0])) if ids else {}
    return {keys.text(k).removeprefix("busy:") for k, v in marks.items() if keys.text(k).startswith("busy:") and v == b"1"}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def submit(env: dict[str, str], path: Path, seconds_per_image: float, *args: str) -> str:
    return cli(env, "submit", str(path), *bench(seconds_per_image), *args).stdout.split()[-1]


@pytest.fixture
def aws(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str, str]:
    """An Auto Scaling group of one instance on the moto server: (its client, its name, the instance)."""
    for name, value in {
        "AWS_ENDPOINT_URL": moto_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    client, group = make_group("us-east-1")
    client.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=1)  # type: ignore[attr-defined]
    found = client.describe_auto_scaling_groups(AutoScalingGroupNames=[group])  # type: ignore[attr-defined]
    return client, group, found["AutoScalingGroups"][0]["Instances"][0]["InstanceId"]


def test_a_node_of_four_restarts_a_killed_worker_retires_a_failed_gpu_holds_protection_while_busy_and_drains(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list, aws: tuple[Any, str, str]
) -> None:
    asg, group, instance = aws

    def protected() -> bool:
        found = asg.describe_auto_scaling_instances(InstanceIds=[instance])["AutoScalingInstances"]
        return bool(found[0]["ProtectedFromScaleIn"])

    with FakeMetadata() as md:
        md.instance_ids["node-1"] = instance
        env = node_env(
            tmp_path,
            redis_server.url,
            4,
            1.0,
            RENDERFLEET_AWS_AUTOSCALING_GROUP=group,
            RENDERFLEET_AWS_METADATA_URL=md.url("node-1"),
            # GPU 2 alone fails at its first render with a CUDA error.
            **{failpoints.VARIABLE: CUDA_ERROR.replace("render=", "render@gpu2=")},
        )
        client = redis.Redis.from_url(redis_server.url)
        node = start_node(env, tmp_path, procs)
        all_up(client, node, 4)
        regs = registered(client)
        assert sorted(regs) == ["0", "1", "2", "3"] and len({r["pid"] for r in regs.values()}) == 4
        assert all(f"-gpu{g}-" in r["worker"] for g, r in regs.items())  # its id says its GPU

        # 1. A worker killed outright is started again on its GPU, after a backoff of a second.
        killed = regs["1"]["pid"]
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: gpu(client, "1").restarts == 1, 30, what="GPU 1's worker to be restarted")
        all_up(client, node, 4)
        assert registered(client)["1"]["pid"] != killed
        assert "the worker of GPU 1 crashed (killed by SIGKILL): restarting in 1 s (restart 1)" in node.output()

        # 2. A job: GPU 2's worker meets its CUDA error, hands its shard back and exits 4; its GPU is
        # retired and never started again, the other three render the job.  The node is protected
        # from scale-in while any of its workers holds a shard, and not once they are idle.
        # 24 prompts in 12 shards: every worker takes some (with 12 the other three could finish before
        # GPU 2's took one, on a loaded machine).
        job = submit(env, write_prompts(tmp_path / "p.txt", 24), 1.0, "--shard-size", "2", "--batch-size", "2")
        seen_protected = []

        def done() -> bool:
            seen_protected.append(protected())
            return bool(status_now(env, job)["done"] == 24)

        wait_for(lambda: states(client).get("2") == "retired", 90, what="GPU 2's worker to meet its error")
        wait_for(done, 120, interval=0.3, what="the job to be rendered by three GPUs")
        assert any(seen_protected), "the node was never protected while its workers rendered"
        wait_for(lambda: not protected(), 20, what="the protection to be lifted once every worker is idle")
        assert states(client) == {"0": "up", "1": "up", "2": "retired", "3": "up"}
        reason = gpu(client, "2").reason
        assert reason == "RuntimeError: CUDA error: an illegal memory access was encountered", reason
        assert "GPU 2 retired, its worker stopped on a device error (exit 4)" in node.output()
        assert md.tokens_issued == 1  # the node asked the metadata service for its instance; no worker did
        out = cli(env, "status").stdout
        assert f"node {record(client).node}: 3 of 4 GPUs up; GPU 2 retired: RuntimeError: CUDA error" in out, out  # type: ignore[union-attr]
        nodes = json.loads(cli(env, "status", "--json").stdout)["nodes"]
        assert [g["state"] for g in nodes[0]["gpus"]] == ["up", "up", "retired", "up"]

        # 3. SIGTERM to the node while its three workers render: each is told, hands its shard back
        # within the grace, and the node exits 0, its protection lifted and its record gone.
        pids = [g.pid for g in record(client).gpus if g.pid]  # type: ignore[union-attr]
        long = submit(env, write_prompts(tmp_path / "q.txt", 12, "long"), 2.0, "--shard-size", "4", "--batch-size", "1")
        wait_for(lambda: busy_gpus(client) == {"0", "1", "3"}, 60, what="the three workers to be busy")
        wait_for(protected, 10, what="the busy node to be protected")
        asked = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(WITHIN) == 0, node.output()[-3000:]
        took = time.monotonic() - asked
        assert took < GRACE + 5.0 + 3.0, took
        assert all(gone(p) for p in pids)
        assert "node: SIGTERM: draining 3 worker(s)" in node.output() and "outlived the grace" not in node.output()
        assert client.zcard(keys.INFLIGHT) == 0  # every shard handed back, none left to a lease
        st = status_now(env, long)
        assert st["done"] < 12 and st["shards_running"] == 0
        assert not protected() and record(client) is None


def test_one_spot_notice_to_the_node_drains_every_worker_within_the_window_and_no_worker_polls_for_it(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list
) -> None:
    with FakeMetadata() as md:
        env = node_env(
            tmp_path,
            redis_server.url,
            3,
            2.0,
            RENDERFLEET_POOL="spot",  # a spot pool: the notice is watched for (RENDERFLEET_RECLAIM_WATCH=auto)
            RENDERFLEET_AWS_METADATA_URL=md.url("node-1"),
            RENDERFLEET_GCP_METADATA_URL=md.url("node-1"),
            RENDERFLEET_RECLAIM_POLL_SECONDS="0.2",
        )
        client = redis.Redis.from_url(redis_server.url)
        node = start_node(env, tmp_path, procs)
        all_up(client, node, 3)
        pids = [g.pid for g in record(client).gpus]  # type: ignore[union-attr]
        job = submit(env, write_prompts(tmp_path / "p.txt", 12), 2.0, "--shard-size", "4", "--batch-size", "1")
        wait_for(lambda: busy_gpus(client) == {"0", "1", "2"}, 60, what="the three workers to be busy")
        md.aws_notice("node-1", seconds=120)
        assert node.proc.wait(WITHIN) == 0, node.output()[-3000:]
        assert time.monotonic() - md.noticed_at["node-1"] < GRACE + 5.0 + 3.0
        assert all(gone(p) for p in pids)
        out = node.output()
        assert "node: reclaim notice (aws spot terminate): draining 3 worker(s)" in out
        assert out.count("reclaim notice: aws spot terminate") == 1  # heard once, by the node
        assert md.tokens_issued == 1  # one metadata client for the node, none per GPU
        st = status_now(env, job)
        assert st["done"] < 12 and st["shards_running"] == 0 and client.zcard(keys.INFLIGHT) == 0


def test_a_node_whose_every_gpu_fails_exits_4_and_status_says_to_replace_it_and_the_local_backend_starts_another(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list
) -> None:
    # The failpoint for every GPU: every worker meets it.
    env = node_env(tmp_path, redis_server.url, 2, 0.05, **{failpoints.VARIABLE: CUDA_ERROR})
    client = redis.Redis.from_url(redis_server.url)
    # Started as the autoscaler's local backend starts a node of a pool of 2 GPUs a node: one supervisor
    # (`worker --gpus 2`), sized in nodes.
    pools = {"default": PoolConfig(gpus_per_node=2, max=2)}
    backend = LocalBackend(client, store=env["RENDERFLEET_STORE"], env=env, log_dir=tmp_path / "logs", pools=pools)
    backend.set_size("default", 1)
    (proc,) = backend._children.values()
    node = WorkerProc.adopt(proc, next((tmp_path / "logs").glob("worker-default-*.log")))
    procs.append(node)
    assert backend.size("default") == 1  # starting: not recorded yet
    all_up(client, node, 2)
    assert backend.size("default") == 1  # one node (its record), not its two workers
    submit(env, write_prompts(tmp_path / "p.txt", 8), 0.05, "--shard-size", "2", "--batch-size", "2")
    assert node.proc.wait(60) == 4, node.output()[-3000:]
    assert states(client) == {"0": "retired", "1": "retired"}
    assert "every GPU retired: replace the node" in cli(env, "status").stdout
    assert backend.size("default") == 0  # a node to replace is no node of the pool: the autoscaler starts another


def test_a_node_refuses_stand_in_gpus_without_their_allowance_a_missing_cuda_and_a_refused_configuration(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = node_env(tmp_path, redis_server.url, 2, 0.05)

    def node(extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "renderfleet", "worker", "--gpus", "all", *args],
            env={k: v for k, v in {**env, **extra}.items() if v},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )

    refused = node({"RENDERFLEET_ALLOW_STAND_IN_GPUS": ""})
    assert refused.returncode == 2 and "RENDERFLEET_ALLOW_STAND_IN_GPUS is off" in refused.stderr, refused.stderr
    import torch

    if not torch.cuda.is_available():
        no_cuda = node({"RENDERFLEET_STAND_IN_GPUS": "", "RENDERFLEET_ALLOW_STAND_IN_GPUS": ""})
        assert no_cuda.returncode == 2 and "no CUDA device on this node" in no_cuda.stderr, no_cuda.stderr
    # Its workers refuse the model (a bench model with no time): the node stops them all and exits 2.
    config = node({}, "--model", "bench:fixed?seconds=0")
    assert config.returncode == 2, config.stderr[-3000:]
    assert "refused its configuration (exit 2): stopping the node" in config.stderr
    assert "restarting" not in config.stderr


def test_the_supervisor_kills_a_worker_that_outlives_the_grace_and_forwards_sigterm_to_the_rest() -> None:
    # Plain processes for workers: one leaves on SIGTERM, one ignores it.
    code = "import signal, sys, time\nif sys.argv[1] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    started: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(label: str) -> subprocess.Popen[bytes]:
        started[label] = subprocess.Popen([sys.executable, "-c", code, label])
        return started[label]

    supervisor = NodeSupervisor(
        NodePolicy(["0", "1"], Backoff()), spawn, grace_seconds=0.5, kill_margin_seconds=0.5, tick_seconds=0.05
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    try:
        wait_for(lambda: len(started) == 2, 10, what="both workers")
        time.sleep(0.5)  # each has set its handler
        asked = time.monotonic()
        supervisor.request_drain("test")
        thread.join(10)
        assert result == [0] and time.monotonic() - asked < 3
        assert started["0"].returncode == -signal.SIGTERM and started["1"].returncode == -signal.SIGKILL
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
