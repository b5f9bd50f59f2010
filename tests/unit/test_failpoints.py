"""Failpoints: inert unless RENDERFLEET_FAILPOINTS names them, its grammar, pause, raise and sleep at the n-th
time, every point the product reaches documented; and no test switch left under another name."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from renderfleet import failpoints
from renderfleet.errors import ConfigError
from renderfleet.failpoints import Failpoint

ROOT = Path(__file__).resolve().parents[2]
# Where the product and its tools live: none of them may read a test switch but through failpoints.
SHIPPED = ["renderfleet", "worker", "dispatcher", "bench", "testing", "infra", "docker", "docs", "examples"]


def shipped_files() -> list[Path]:
    files = [p for folder in SHIPPED for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return [*files, ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has reached no failpoint yet."""
    monkeypatch.setattr(failpoints, "_reached", {})
    monkeypatch.setattr(failpoints, "_paused", set())


def test_with_the_variable_unset_no_failpoint_is_active_and_reaching_any_does_nothing(
    monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    monkeypatch.delenv(failpoints.VARIABLE, raising=False)
    assert failpoints.active() == {} and failpoints.describe() == "none"
    for point in failpoints.POINTS:
        for _ in range(3):
            failpoints.reach(point)  # no pause (this process would stop), no raise
    monkeypatch.setenv(failpoints.VARIABLE, "")
    assert failpoints.active() == {}
    failpoints.reach("render")


def test_the_variable_names_points_and_actions() -> None:
    value = (
        "before-claim=pause; before-checkpoint#3=pause;"
        "render=raise(AcceleratorError: CUDA error: an illegal memory access (at x))"
    )
    assert failpoints.parse(value) == {
        "before-claim": Failpoint("before-claim", "pause"),
        "before-checkpoint": Failpoint("before-checkpoint", "pause", 3),
        "render": Failpoint("render", "raise", 1, "AcceleratorError", "CUDA error: an illegal memory access (at x)"),
    }
    assert "; ".join(map(str, failpoints.parse(value).values())) == (
        "before-claim=pause; before-checkpoint#3=pause; "
        "render=raise(AcceleratorError: CUDA error: an illegal memory access (at x))"
    )


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("befor-claim=pause", "no failpoint 'befor-claim'; the points are before-claim"),
        ("before-claim", "'before-claim' is not POINT[#N]=pause"),
        ("before-claim=stop", "is not POINT[#N]=pause, POINT[#N]=raise(TYPE: TEXT)"),
        ("before-claim#0=pause", "is not POINT[#N]=pause"),
        ("render=raise(SystemExit: bye)", "render: cannot raise 'SystemExit'"),
        ("render=raise(boom)", "is not POINT[#N]=pause"),
        ("render=pause;render#2=pause", "failpoint 'render' is named twice"),
    ],
)
def test_a_value_that_will_not_do_is_a_config_error_naming_the_variable(value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        failpoints.parse(value)
    assert str(caught.value).startswith(f"{failpoints.VARIABLE}: ") and reason in str(caught.value)


def test_a_failpoint_for_one_gpu_applies_only_in_the_worker_of_that_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    value = "render@gpu2=raise(RuntimeError: CUDA error: one card); before-claim#2@gpu1=pause; after-render=pause"
    card = Failpoint("render", "raise", 1, "RuntimeError", "CUDA error: one card", gpu="2")
    assert failpoints.parse(value, "2") == {"render": card, "after-render": Failpoint("after-render", "pause")}
    assert set(failpoints.parse(value, "1")) == {"before-claim", "after-render"}
    assert set(failpoints.parse(value)) == {"after-render"}  # not a node's worker: for every process only
    assert "; ".join(map(str, failpoints.named(value))) == value
    monkeypatch.setenv(failpoints.VARIABLE, value)
    monkeypatch.setenv(failpoints.GPU_VARIABLE, "2")
    assert failpoints.active()["render"] == card
    monkeypatch.setenv(failpoints.GPU_VARIABLE, "3")
    assert "render" not in failpoints.active()
    # Once per GPU, never for every process and for one GPU besides.
    assert len(failpoints.named("render@gpu1=pause; render@gpu2=pause")) == 2
    for twice in (
        "render=pause; render@gpu2=pause",
        "render@gpu2=pause; render=pause",
        "render@gpu2=pause;render@gpu2=pause",
    ):
        with pytest.raises(ConfigError, match="failpoint 'render' is named twice"):
            failpoints.parse(twice)


def test_a_raise_fires_every_time_from_the_nth_time_on(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    monkeypatch.setenv(failpoints.VARIABLE, "render#2=raise(ValueError: CUDA error in a check)")
    failpoints.reach("render")  # the first time: passes
    failpoints.reach("after-render")  # another point: not named
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^CUDA error in a check$"):
            failpoints.reach("render")
    monkeypatch.setenv(failpoints.VARIABLE, "render=raise(RuntimeError: now this)")  # read again when changed
    with pytest.raises(RuntimeError, match="now this"):
        failpoints.reach("render")


def test_a_sleep_sleeps_its_seconds_every_time_from_the_nth_time_on_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)  # what it asks of the clock, not how long it took
    monkeypatch.setenv(failpoints.VARIABLE, "step#3=sleep(0.25); render=pause")
    assert failpoints.active()["step"] == Failpoint("step", "sleep", 3, seconds=0.25)
    assert failpoints.describe() == "step#3=sleep(0.25); render=pause"
    for _ in range(5):
        failpoints.reach("step")  # returns: no raise, no pause
    failpoints.reach("after-render")  # another point: not named
    assert slept == [0.25, 0.25, 0.25]  # the 3rd, 4th and 5th times
    monkeypatch.setenv(failpoints.VARIABLE, "step@gpu1=sleep(2)")
    monkeypatch.setenv(failpoints.GPU_VARIABLE, "1")
    assert str(failpoints.active()["step"]) == "step@gpu1=sleep(2)"
    failpoints.reach("step")
    assert slept == [0.25, 0.25, 0.25, 2.0]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("step=sleep(0)", "step: cannot sleep 0 s"),
        ("step=sleep(61)", "step: cannot sleep 61 s"),
        ("step=sleep(-1)", "is not POINT[#N]=pause, POINT[#N]=raise(TYPE: TEXT), POINT[#N]=sleep(SECONDS)"),
        ("step=sleep(1e-3)", "is not POINT[#N]=pause"),
        ("step=sleep()", "is not POINT[#N]=pause"),
        ("step=sleep(0.1);step#2=sleep(0.2)", "failpoint 'step' is named twice"),
    ],
)
def test_a_sleep_that_will_not_do_is_a_config_error(value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        failpoints.parse(value)
    assert str(caught.value).startswith(f"{failpoints.VARIABLE}: ") and reason in str(caught.value)


CHILD = """
import sys
from renderfleet import failpoints
for n in (1, 2, 3):
    failpoints.reach("before-claim")
    print(n, flush=True)
"""


def test_a_pause_stops_the_process_at_the_nth_time_only(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), failpoints.VARIABLE: "before-claim#2=pause", "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "1\n"  # the first time: no pause
        deadline = time.monotonic() + 60
        while not stopped(child.pid):
            assert time.monotonic() < deadline, "the child never stopped at the second time"
            assert child.poll() is None, child.stdout.read()
            time.sleep(0.02)
        child.send_signal(signal.SIGCONT)
        assert child.stdout.read() == "2\n3\n"  # the third time: no second pause
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def test_every_point_the_product_reaches_is_a_documented_failpoint_and_every_one_is_reached() -> None:
    reached: dict[str, list[str]] = {}
    for path in shipped_files():
        if path.suffix == ".py" and path.parts[len(ROOT.parts)] in ("renderfleet", "worker", "dispatcher"):
            for point in re.findall(r'failpoints\.reach\("([^"]+)"\)', path.read_text()):
                reached.setdefault(point, []).append(str(path.relative_to(ROOT)))
    assert sorted(reached) == sorted(failpoints.POINTS)
    for point, where in reached.items():
        assert all(w in failpoints.POINTS[point] for w in where), (point, where)
    design = (ROOT / "docs" / "design.md").read_text()
    assert failpoints.VARIABLE in design and all(f"`{point}`" in design for point in failpoints.POINTS)


def test_no_test_switch_is_left_in_the_product_under_another_name() -> None:
    old = "RENDERFLEET_" + "TEST_"  # spelled apart: this file is not the product
    assert [str(p.relative_to(ROOT)) for p in shipped_files() if old in p.read_text(errors="replace")] == []
    readers = [
        str(p.relative_to(ROOT))
        for p in shipped_files()
        if p.suffix == ".py"
        and p.parts[len(ROOT.parts)] in ("renderfleet", "worker", "dispatcher")
        and failpoints.VARIABLE in p.read_text()
    ]
    assert readers == ["renderfleet/failpoints.py"]  # the one module that reads the variable
