"""Random histories of a job's names against a real fleet, checked against a model (Hypothesis's
rule-based state machine, the way Jepsen checks operation histories).

Each history starts from an empty Redis (our own server) and store, two real workers on a bench model
and, drawn, a monitor, and whether the history's jobs have an upscale stage on a pool of its own (``big``,
with a worker of its own: a shard is rendered a segment at a time, the second on that pool; issue 45
item 1); then a random sequence of: submit one of two prompt files under one of two
names (a new life, the same job again, or another file refused), cancel, delete stopped after each of
its steps (the fence, the store emptied, the whole delete), resume, a worker paused past its lease
(SIGSTOP, woken by a later step or at the end), a worker killed (SIGKILL) or handed off (SIGTERM, the
spot notice) and replaced, in whichever segment it is, a Redis restart (with a monitor: it heals a lost
Redis).  After each history, with every worker awake:

* every image in a name's folder carries a prompt of the file of that name's current life;
* every job that is not cancelled finishes without a person (every shard through every segment: none
  stranded between pools), and its counts equal the store;
* a deleted name leaves nothing in the store and nothing in Redis but its tombstone;
* a life no worker was paused or killed in counts exactly its prompts' images, no more (no counter of
  a dead life survives).

The machine bounds itself, never an outside timeout cutting a history in half: it draws histories
(up to :data:`EXAMPLES`, of up to :data:`STEPS` steps) until its own time budget, :data:`BUDGET`
seconds, is spent, and then draws no more (a history begun finishes; the count run is printed).  Every
wait inside a step is bounded and fails the history with the step's name, the history so far (each
step is a Hypothesis ``note``) and the tail of every worker's and the monitor's log.  No shrinking: a
history of real processes replays with other timings, so the failing history is reported as it ran,
with the blob that replays its draws (``@reproduce_failure``).  ``make test`` spends about a minute and a half
on it; ``make test-slow`` more (``RENDERFLEET_MACHINE_SECONDS``, ``RENDERFLEET_MACHINE_EXAMPLES``).
Histories it finds become tests in tests/integration/test_lives.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, Verbosity, note, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test
from PIL import Image

from dispatcher.jobs import lifecycle
from renderfleet import keys, spec
from renderfleet.api import Client
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import InputError, JobDeleted, JobNotFound
from renderfleet.spec import bench_model
from testing.fleet import (
    WorkerProc,
    base_env,
    bench_worker,
    start_monitor,
    status_now,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("RENDERFLEET_MACHINE_EXAMPLES", "40"))
# The seconds after which no new history is drawn (one begun runs to its end: at most HISTORY_BOUND more).
BUDGET = float(os.environ.get("RENDERFLEET_MACHINE_SECONDS", "50"))
# The most one history can take, its waits added up on a loaded machine: the test's own timeout is
# BUDGET + HISTORY_BOUND, so pytest-timeout never cuts a history in half (issue 49).
HISTORY_BOUND = 240
STEPS = int(os.environ.get("RENDERFLEET_MACHINE_STEPS", "8"))
VERBOSE = bool(os.environ.get("RENDERFLEET_MACHINE_VERBOSE"))  # each step printed as it runs
NAMES = ("life-a", "life-b")
FILES = ("A", "B")  # the prompt files' prefixes: every prompt of file A begins "A prompt"
PROMPTS = 4
SECONDS_PER_IMAGE = 0.01
STAGE_POOL = "big"  # a staged history's upscale runs here, on a worker of its own


class Name:
    """What the model expects of one job name."""

    def __init__(self) -> None:
        self.file: str | None = None  # the current life's prompt file, None when no life is stored
        self.cancelled = False
        self.deleted = False  # a whole delete, with no life since
        self.disturbed = False  # a worker was paused or killed, or Redis lost, during this life
        self.redis_only = False  # a delete stopped after it emptied the store: Redis holds a cancelled job


class BudgetSpent(KeyboardInterrupt):
    """Ends the run when the budget is spent, before a history starts.  A KeyboardInterrupt because that is
    what Hypothesis re-raises at once, recording nothing (its engine: "don't save or treat this as a test
    failure"); a rejection or any other exception would be an outcome that depends on the clock, which
    Hypothesis rightly reports as a flaky strategy.  :func:`run_histories` catches it."""


class Budget:
    """When the machine stops drawing histories: after ``seconds``, unless a history failed (its replay
    must run whatever the clock says, or Hypothesis takes the replay's rejection for a flaky test)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.histories = 0  # begun and run to their end
        self.checked = 0  # whose end-of-history checks ran and held
        self.failed = False

    def spent(self) -> bool:
        return not self.failed and time.monotonic() > self.deadline


def make_machine(tmp: Path, redis_server: RedisServerProcess, budget: Budget) -> type[RuleBasedStateMachine]:
    files = {f: write_prompts(tmp / f"{f}.txt", PROMPTS, prefix=f"{f} prompt") for f in FILES}
    counter = [0]

    class Lives(RuleBasedStateMachine):
        def __init__(self) -> None:
            if budget.spent():
                raise BudgetSpent  # before anything starts: no history is drawn past the budget
            super().__init__()
            counter[0] += 1
            self.store_dir = tmp / f"store-{counter[0]}"
            # The monitor's audit every 2 s, not 30: a message a SIGKILLed worker took before its claim is back
            # within two audits (docs/failures.md), well inside a check's wait.
            self.env = base_env(
                tmp, redis_server.url, str(self.store_dir), RENDERFLEET_AUDIT_SECONDS="2", **bench_worker(SECONDS_PER_IMAGE)
            )
            self.r = redis.Redis.from_url(redis_server.url)
            self.r.flushall()
            self.client = Client(redis_url=redis_server.url, store=str(self.store_dir))
            self.names = {n: Name() for n in NAMES}
            self.workers: list[WorkerProc] = []
            self.pools: list[str] = []  # each worker's pool, by index
            self.staged = False  # the history's jobs upscale on STAGE_POOL
            self.paused: set[int] = set()
            self.monitor: Any = None
            self.sigkilled = False  # a worker SIGKILLed: it may have taken a message it never claimed
            self.kills = 0  # one kill a history: each replacement costs a worker's start, and the histories' time
            self.logs = tmp / f"history-{counter[0]}"
            self.logs.mkdir()

        @initialize(monitor=st.booleans(), staged=st.booleans())
        def start(self, monitor: bool, staged: bool) -> None:
            self.staged = staged
            extra = f", a {STAGE_POOL} worker for the upscale" if staged else ""
            self._step(f"start: two workers{extra}{', a monitor' if monitor else ''}")
            for pool in ["default", "default", *([STAGE_POOL] if staged else [])]:
                self._add_worker(pool)
            if monitor:
                self.monitor = start_monitor(self.env, self.logs / "monitor.log")
            wait_for(lambda: worker_ready(self.r, len(self.workers)), 60, what=f"{len(self.workers)} workers")

        def _step(self, what: str) -> None:
            note(what)  # printed with the failing history
            if VERBOSE:
                print(f"history {counter[0]}: {what}", flush=True)

        def _add_worker(self, pool: str) -> None:
            self.pools.append(pool)
            self.workers.append(self._worker(len(self.workers)))

        def _worker(self, i: int, again: str = "") -> WorkerProc:
            return WorkerProc({**self.env, "RENDERFLEET_POOL": self.pools[i]}, self.logs / f"worker-{i}{again}.log")

        # ---- the operations --------------------------------------------------------------

        @rule(name=st.sampled_from(NAMES), file=st.sampled_from(FILES))
        def submit(self, name: str, file: str) -> None:
            state = self.names[name]
            stored = self.client.store.exists(spec.spec_key(name))
            self._step(f"submit {file} as {name}")
            try:
                self.client.submit(
                    files[file],
                    model=bench_model(SECONDS_PER_IMAGE),
                    steps=2,
                    size="32x32",
                    shard_size=2,
                    batch_size=2,
                    job=name,
                    **({"stages": [f"upscale:2@{STAGE_POOL}"]} if self.staged else {}),
                )
            except InputError as exc:
                assert stored and state.file != file, f"submit of {file} under {name} refused: {exc}"
                return
            assert not (stored and state.file not in (None, file)), "another file resumed as the stored job"
            if not stored:
                state.disturbed = False  # a new life
            state.file, state.cancelled, state.deleted, state.redis_only = file, False, False, False

        @precondition(lambda self: any(n.file for n in self.names.values()))
        @rule(name=st.sampled_from(NAMES))
        def cancel(self, name: str) -> None:
            state = self.names[name]
            self._step(f"cancel {name}")
            try:
                self.client.job(name).cancel()
            except (JobDeleted, JobNotFound):
                assert state.file is None or state.redis_only
                return
            assert state.file is not None
            state.cancelled = True

        @precondition(lambda self: any(n.file or n.redis_only for n in self.names.values()))
        @rule(name=st.sampled_from(NAMES), stop_after=st.sampled_from(["fence", "store", "whole"]))
        def delete(self, name: str, stop_after: str) -> None:
            """``renderfleet delete``, or its first steps only, as a Ctrl-C would stop it."""
            state = self.names[name]
            self._step(f"delete {name}, stopped after: {stop_after}")
            if stop_after == "whole":
                try:
                    self.client.job(name).delete()
                except (JobDeleted, JobNotFound):
                    assert state.file is None and not state.redis_only
                    return
                state.file, state.cancelled, state.deleted, state.redis_only = None, True, True, False
                return
            if not self.r.hexists(keys.job(name), "spec"):
                return  # nothing in Redis to stop half-way through
            lifecycle._cancel(self.r, name, fence=True)
            state.cancelled = True
            if stop_after == "store":
                self.client.store.delete_prefix(spec.job_prefix(name))
                state.file, state.redis_only = None, True

        @precondition(lambda self: any(n.file for n in self.names.values()))
        @rule(name=st.sampled_from(NAMES))
        def resume(self, name: str) -> None:
            state = self.names[name]
            self._step(f"resume {name}")
            try:
                self.client.job(name).resume()
            except (JobDeleted, JobNotFound):
                assert state.file is None
                return
            state.cancelled = False

        @precondition(lambda self: len(self.paused) < len(self.workers))
        @rule(data=st.data())
        def pause_worker(self, data: st.DataObject) -> None:
            """A worker stalls (SIGSTOP) until a later step wakes it: past its lease if anything waits."""
            i = data.draw(st.sampled_from([i for i in range(len(self.workers)) if i not in self.paused]))
            self._step(f"pause worker {i}")
            os.kill(self.workers[i].pid, signal.SIGSTOP)
            self.paused.add(i)
            for state in self.names.values():
                state.disturbed = True

        @precondition(lambda self: bool(self.paused))
        @rule(data=st.data(), after=st.sampled_from([0.0, 4.0]))
        def wake_worker(self, data: st.DataObject, after: float) -> None:
            i = data.draw(st.sampled_from(sorted(self.paused)))
            self._step(f"wake worker {i} after {after} s")
            time.sleep(after)  # 4 s: past its 3 s lease
            os.kill(self.workers[i].pid, signal.SIGCONT)
            self.paused.discard(i)

        @precondition(lambda self: len(self.paused) < len(self.workers) and self.kills == 0)
        @rule(data=st.data(), how=st.sampled_from(["kill", "SIGTERM"]))
        def kill_worker(self, data: st.DataObject, how: str) -> None:
            """A worker gone (SIGKILL: a node vanishing; SIGTERM: the spot notice's hand-off) and another started
            on its pool, whichever segment it was rendering."""
            i = data.draw(st.sampled_from([i for i in range(len(self.workers)) if i not in self.paused]))
            self._step(f"{how} worker {i} ({self.pools[i]}), start another")
            self.kills += 1
            if how == "kill":
                self.workers[i].kill()
                self.sigkilled = True
            else:
                self.workers[i].terminate(timeout=30)
            self.workers[i] = self._worker(i, f"-again-{time.monotonic():.0f}")
            for state in self.names.values():
                state.disturbed = True

        @precondition(lambda self: self.monitor is not None)
        @rule()
        def restart_redis(self) -> None:
            """Redis loses its memory; the monitor rebuilds every stored job from the store."""
            self._step("restart Redis, empty")
            redis_server.kill()
            redis_server.start()
            for state in self.names.values():
                state.disturbed = True
                state.redis_only = False

        @invariant()
        def workers_alive(self) -> None:
            for i, w in enumerate(self.workers):
                assert w.alive(), f"worker {i} died:\n{w.output()[-3000:]}"

        # ---- the checks after the history --------------------------------------------------

        def teardown(self) -> None:
            # Called in Hypothesis's ``finally``: an exception in flight is a step's or an invariant's failure,
            # unless it is Hypothesis's own (a draw past the end of its data, StopTest, ends a history early).
            in_flight = sys.exc_info()[1]
            failed = isinstance(in_flight, Exception) and not isinstance(in_flight, HypothesisException)
            try:
                for i in sorted(self.paused):
                    os.kill(self.workers[i].pid, signal.SIGCONT)
                self.paused.clear()
                if not failed:
                    self._check()
                    budget.checked += 1
            except BaseException:
                failed = True
                raise
            finally:
                budget.histories += 1
                if failed:
                    budget.failed = True
                    self._show_logs()
                for w in self.workers:
                    w.kill()
                if self.monitor is not None:
                    os.killpg(self.monitor.pid, signal.SIGKILL)
                    self.monitor.wait(10)

        def _show_logs(self) -> None:
            """Each process's log tail, printed with the failing history (pytest shows it)."""
            for log in sorted(self.logs.glob("*.log")):
                text = log.read_text(errors="replace")
                print(f"---- {log.name} (last 4000 characters) ----\n{text[-4000:]}")

        def _check(self) -> None:
            if self.monitor is None and self.sigkilled:
                # A worker SIGKILLed after it took a message from its queue and before its claim leaves that shard
                # to the monitor's audit (docs/failures.md, "A message lost before its claim"); a fleet without a
                # monitor waits Celery's visibility timeout, an hour.  The fleet as deployed runs one: it starts
                # now, for the check (a CI run's history stranded a shard so, issue 50).
                self.monitor = start_monitor(self.env, self.logs / "monitor.log")
            for name, state in self.names.items():
                folder = self.store_dir / "jobs" / name
                if state.file and not state.cancelled:
                    # Redis's count too: after a restart status counts the store until the monitor has the job back.
                    wait_for(
                        lambda n=name: status_now(self.env, n)["done"] == PROMPTS == self.r.bitcount(keys.done_bits(n)),
                        60,
                        interval=0.25,
                        what=f"{name} (file {state.file}) to finish without a person",
                    )
                want = f"{state.file} prompt"

                def images_now(folder: Path = folder) -> dict[str, str]:
                    return {p.name: Image.open(p).text["prompt"] for p in sorted((folder / "images").glob("*.png"))}

                # A worker woken at the end may have a late write of an ended life in flight: its writer withdraws
                # it once its fence check fails (docs/design.md "Writes of an ended life").  Bounded, then checked.
                with contextlib.suppress(AssertionError):
                    wait_for(lambda w=want: all(p.startswith(w) for p in images_now().values()), 15, interval=0.25)
                images = images_now()
                assert all(p.startswith(want) for p in images.values()), (name, state.file, images)
                if state.file and not state.cancelled:
                    st_ = status_now(self.env, name)
                    assert len(images) == st_["done"] == PROMPTS, (name, st_, images)
                    assert self.r.bitcount(keys.done_bits(name)) == PROMPTS
                    if not state.disturbed:
                        stats = {keys.text(k): int(v) for k, v in self.r.hgetall(keys.job_stats(name)).items()}
                        # Each segment counts its images (the pool that made them): an upscaled job's twice.
                        segments = 2 if self.staged else 1
                        assert sum(v for k, v in stats.items() if k.startswith("images.")) == PROMPTS * segments, (
                            name,
                            stats,
                        )
                        if self.staged:
                            made = {keys.text(k): int(v) for k, v in self.r.hgetall(keys.job_stages(name)).items()}
                            assert made.get("images.generate") == made.get("images.upscale-1") == PROMPTS, (name, made)
                if state.deleted:
                    time.sleep(0.5)  # a fenced worker's last word, if it had one, lands now
                    assert not folder.exists() or not any(p.is_file() for p in folder.rglob("*")), (
                        name,
                        sorted(str(p) for p in folder.rglob("*")),
                    )
                    left = sorted(keys.text(k) for k in self.r.scan_iter(match=f"rf:job:{name}*"))
                    assert set(left) <= {keys.job(name), keys.attempts(name)}, (name, left)

    return Lives


def run_histories(tmp: Path, redis_server: RedisServerProcess, examples: int, steps: int, seconds: float) -> None:
    budget = Budget(seconds)
    started = time.monotonic()
    try:
        run_state_machine_as_test(
            make_machine(tmp, redis_server, budget),
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                # A history's time is its processes', not Hypothesis's to judge: the budget bounds the run.
                deadline=None,
                derandomize=False,
                suppress_health_check=list(HealthCheck),
                database=None,
                # Generate only: a shrink would replay real-process histories, whose timings differ, for minutes.
                phases=[Phase.explicit, Phase.generate],
                print_blob=True,
                report_multiple_bugs=False,
                verbosity=Verbosity.verbose if VERBOSE else Verbosity.normal,
            ),
        )
    except BudgetSpent:
        pass
    finally:
        print(
            f"lives machine: {budget.histories} histories of up to {steps} steps ({budget.checked} checked) in "
            f"{time.monotonic() - started:.0f} s (budget {seconds:.0f} s, at most {examples})"
        )
    assert budget.checked >= 1, "the budget was spent before a single history ran and was checked"


@pytest.mark.timeout(BUDGET + HISTORY_BOUND)
def test_random_histories_of_a_jobs_names_keep_every_life_apart(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    run_histories(tmp_path, redis_server, EXAMPLES, STEPS, BUDGET)


SLOW_BUDGET = max(BUDGET, 600.0)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_BUDGET + HISTORY_BOUND)
def test_many_random_histories_of_a_jobs_names_keep_every_life_apart(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    run_histories(tmp_path, redis_server, max(EXAMPLES, 200), max(STEPS, 12), SLOW_BUDGET)
