"""A node supervisor's policy (worker/node/policy.py): which GPUs, and what each worker's exit means.
Pure logic, a clock given as numbers; the processes themselves are in tests/integration/test_node.py."""

from __future__ import annotations

import signal

import pytest

from renderfleet.errors import ConfigError
from renderfleet.nodes import GpuRecord, GpuState, NodeRecord, NodeState
from renderfleet.settings import Settings, load_settings
from worker.node.policy import EXIT_CONFIG, EXIT_DEVICE, Backoff, NodePolicy, exit_text, pick_gpus

KILLED = -signal.SIGKILL
BACKOFF = Backoff(first_seconds=1, cap_seconds=16, healthy_seconds=100)


def running(gpus: list[str], now: float = 0.0) -> NodePolicy:
    policy = NodePolicy(gpus, BACKOFF)
    assert policy.due(now) == gpus  # every GPU's worker starts at once
    for gpu in gpus:
        policy.started(gpu, now)
    assert policy.due(now) == [] and not policy.finished
    return policy


def test_a_crashed_worker_restarts_after_1_2_4_8_16_16_seconds() -> None:
    policy = running(["0", "1"])
    now, waits = 0.0, []
    for _ in range(6):
        now += 5  # a short run: a crash loop
        assert policy.exited("0", KILLED, now) == GpuState.RESTARTING
        slot = policy.slots["0"]
        waits.append(slot.restart_at - now)
        assert policy.due(slot.restart_at - 0.01) == [] and policy.due(slot.restart_at) == ["0"]
        now = slot.restart_at
        policy.started("0", now)
    assert waits == [1, 2, 4, 8, 16, 16]
    assert policy.slots["0"].restarts == 6 and policy.slots["0"].reason == "killed by SIGKILL"
    assert policy.slots["1"].state == GpuState.UP and not policy.finished  # the other GPU never noticed


def test_a_long_healthy_run_starts_the_backoff_again_from_the_first() -> None:
    policy = running(["0"])
    for now in (1.0, 3.0, 7.0):  # three quick crashes: 1, 2, 4 s
        policy.exited("0", 1, now)
        policy.started("0", policy.slots["0"].restart_at)
    assert policy.slots["0"].crashes == 3
    started = policy.slots["0"].started_at
    policy.exited("0", 3, started + 100)  # the breaker's exit, after a healthy run
    assert policy.slots["0"].restart_at - (started + 100) == 1 and policy.slots["0"].reason == "exit 3"


def test_a_device_error_retires_its_gpu_for_good_and_the_node_carries_on() -> None:
    policy = running(["0", "1", "2", "3"])
    reason = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert policy.exited("2", EXIT_DEVICE, 10, reason) == GpuState.RETIRED
    assert policy.due(10_000) == [] and not policy.finished
    assert policy.slots["2"].reason == reason
    assert [g.state for g in policy.records({})] == ["up", "up", "retired", "up"]
    assert policy.exited("1", EXIT_DEVICE, 20) == GpuState.RETIRED
    assert policy.slots["1"].reason == "device error (exit 4)"  # the worker said nothing more


def test_the_node_exits_4_when_every_gpu_is_retired_and_not_before() -> None:
    policy = running(["0", "1"])
    policy.exited("0", EXIT_DEVICE, 1)
    assert not policy.finished
    policy.exited("1", EXIT_DEVICE, 2)
    assert policy.finished and policy.exit_status() == EXIT_DEVICE


def test_a_drain_starts_nothing_more_stops_a_gpu_waiting_to_restart_and_exits_0() -> None:
    policy = running(["0", "1", "2"])
    policy.exited("1", KILLED, 1)  # waiting for its restart
    policy.exited("2", EXIT_DEVICE, 1)  # retired before the drain
    policy.drain("SIGTERM")
    assert policy.slots["1"].state == GpuState.STOPPED and policy.due(100) == []
    assert not policy.finished  # GPU 0's worker still hands its shard back
    assert policy.exited("0", KILLED, 2) == GpuState.STOPPED  # killed after the grace: not restarted
    assert policy.finished and policy.exit_status() == 0


def test_a_worker_exiting_0_on_its_own_is_not_restarted() -> None:
    policy = running(["0", "1"])
    assert policy.exited("0", 0, 5) == GpuState.STOPPED and policy.due(1000) == []
    policy.exited("1", 0, 6)
    assert policy.finished and policy.exit_status() == 0


def test_a_refused_configuration_drains_the_node_which_exits_2() -> None:
    policy = running(["0", "1"])
    assert policy.exited("0", EXIT_CONFIG, 1) == GpuState.REFUSED
    assert policy.draining is not None and "refused its configuration" in policy.draining
    policy.exited("1", 0, 2)
    assert policy.finished and policy.exit_status() == EXIT_CONFIG


def test_how_a_worker_ended_is_said_in_words() -> None:
    assert exit_text(3) == "exit 3" and exit_text(-signal.SIGSEGV) == "killed by SIGSEGV"


# ---- which GPUs ------------------------------------------------------------------


def test_gpus_all_n_or_indexes_pick_the_nodes_own_device_names() -> None:
    visible = ["4", "5", "6", "7"]  # the node was given CUDA_VISIBLE_DEVICES=4,5,6,7
    assert pick_gpus("all", visible) == [("0", "4"), ("1", "5"), ("2", "6"), ("3", "7")]
    assert pick_gpus("2", visible) == [("0", "4"), ("1", "5")]
    assert pick_gpus("0,2,3", visible) == [("0", "4"), ("2", "6"), ("3", "7")]


@pytest.mark.parametrize(
    ("spec", "visible", "says"),
    [
        ("all", [], "no CUDA device on this node"),
        ("5", ["0", "1"], "this node has 2 CUDA device(s); give 1 to 2"),
        ("0,4", ["0", "1"], "no GPU 4 on this node (2 CUDA device(s): 0 to 1)"),
    ],
)
def test_gpus_the_node_does_not_have_are_refused_naming_the_flag(spec: str, visible: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match="--gpus") as err:
        pick_gpus(spec, visible)
    assert says in str(err.value)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "a count of GPUs is 1 or more"),
        ("some", "must be all, a count of GPUs (2) or their indexes"),
        ("0,x", "must be all"),
        ("1,1", "a GPU is named twice"),
    ],
)
def test_a_gpus_setting_that_will_not_do_is_refused_by_name(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match="RENDERFLEET_GPUS") as err:
        load_settings(gpus=value)
    assert says in str(err.value)


def test_stand_in_gpus_are_refused_without_their_allowance_as_a_bench_model_is() -> None:
    from worker.node.supervisor import node_gpus

    with pytest.raises(ConfigError, match="RENDERFLEET_ALLOW_STAND_IN_GPUS is off"):
        node_gpus(Settings(gpus="all", stand_in_gpus=4))
    assert node_gpus(Settings(gpus="1,3", stand_in_gpus=4, allow_stand_in_gpus=True)) == [("1", "1"), ("3", "3")]


def test_a_worker_of_a_node_leaves_the_reclaim_notices_to_its_node() -> None:
    assert Settings(pool="spot").watch_reclaim
    assert not Settings(pool="spot", reclaim_watch="on", node="n-1", node_gpu="2").watch_reclaim


# ---- the node's record -------------------------------------------------------------


def test_the_nodes_record_says_in_one_line_which_gpus_are_not_up_and_why() -> None:
    record = NodeRecord(
        "ip-10-0-1-5-812",
        gpus=[
            GpuRecord("0", GpuState.UP, pid=9),
            GpuRecord("1", GpuState.RESTARTING, "killed by SIGKILL", restarts=2),
            GpuRecord("2", GpuState.RETIRED, "RuntimeError: CUDA error: an illegal memory access was encountered"),
            GpuRecord("3", GpuState.UP),
        ],
    )
    assert record.troubled() and record.summary() == (
        "node ip-10-0-1-5-812: 2 of 4 GPUs up; GPU 1 restarting (2 restarts: killed by SIGKILL); "
        "GPU 2 retired: RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert NodeRecord.from_json(record.to_json()) == record
    gone = NodeRecord("n", state=NodeState.REPLACE, gpus=[GpuRecord("0", GpuState.RETIRED)])
    assert gone.summary() == "node n: 0 of 1 GPUs up (every GPU retired: replace the node); GPU 0 retired: device error"
    assert not NodeRecord("n", gpus=[GpuRecord("0", GpuState.UP)]).troubled()
    for junk in ("{", "[]", '{"node": "n", "gpus": [{"gpu": 0, "state": "melted"}]}', "null"):
        assert NodeRecord.from_json(junk) is None


def test_status_the_page_and_the_monitors_metrics_say_a_nodes_gpu_is_retired() -> None:
    from rich.console import Console

    from dispatcher.fleet.fleetmetrics import FleetCollector
    from dispatcher.status.status import FleetStatus
    from dispatcher.views.show import render_status
    from dispatcher.views.web import make_app
    from tests.unit.test_web import _call

    node = NodeRecord(
        "ip-10-0-1-5-812",
        pool="spot",
        gpus=[GpuRecord("0", GpuState.UP), GpuRecord("1", GpuState.RETIRED, "RuntimeError: CUDA error: ECC error")],
    )
    healthy = NodeRecord("ip-10-0-1-6-90", pool="spot", gpus=[GpuRecord("0", GpuState.UP), GpuRecord("1", GpuState.UP)])
    fleet = FleetStatus(queues={}, store="/x", nodes=[node, healthy])
    line = "node ip-10-0-1-5-812: 1 of 2 GPUs up; GPU 1 retired: RuntimeError: CUDA error: ECC error"
    console = Console(width=200, record=True)
    console.print(render_status(fleet, console))
    text = console.export_text()
    assert line in text and "ip-10-0-1-6-90" not in text  # a node with every GPU up says nothing
    assert fleet.to_dict()["nodes"][0]["summary"] == line
    assert line in _call(make_app(lambda: fleet, {}, None), "/")[2].decode()
    [gauge] = [m for m in FleetCollector(lambda: fleet, {}).collect() if m.name == "renderfleet_node_gpus"]
    assert {tuple(s.labels.values()): s.value for s in gauge.samples} == {("spot", "up"): 3, ("spot", "retired"): 1}
