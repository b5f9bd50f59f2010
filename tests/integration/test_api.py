"""The Python API against real servers: submit from code, wait, read results.

The worker serves a bench model (``testing.fleet.bench_worker``: no torch, a fixed time per image)
where the test is about the API, and the tiny model where it runs the guide's example as written.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from renderfleet import Client, PromptRequest
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import InputError
from renderfleet.spec import bench_model
from testing.fleet import REPO, WorkerProc, base_env, bench, bench_worker, wait_for, worker_ready

pytestmark = pytest.mark.integration


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"))


@pytest.fixture
def client(env: dict[str, str]) -> Client:
    return Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])


def start_worker(tmp_path: Path, env: dict[str, str]) -> Iterator[WorkerProc]:
    proc = WorkerProc(env, tmp_path / "worker.log")
    wait_for(
        lambda: worker_ready(redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]), 1), 90, what="worker to load the model"
    )
    yield proc
    proc.kill()


@pytest.fixture
def worker(tmp_path: Path, env: dict[str, str]) -> Iterator[WorkerProc]:
    """A worker on the tiny model."""
    yield from start_worker(tmp_path, env)


@pytest.fixture
def bench_worker_proc(tmp_path: Path, env: dict[str, str]) -> Iterator[WorkerProc]:
    """A worker on the bench model of :data:`BENCH`."""
    yield from start_worker(tmp_path, {**env, **bench_worker(SECONDS_PER_IMAGE)})


TINY = {"model": "tiny", "steps": 2, "size": "32x32"}
SECONDS_PER_IMAGE = 0.02
BENCH = {"model": bench_model(SECONDS_PER_IMAGE), "steps": 2, "size": "32x32"}


def test_submit_a_list_wait_and_read_results_and_resubmit_idempotently(
    client: Client, bench_worker_proc: WorkerProc, tmp_path: Path
) -> None:
    items = ["a red fox", {"prompt": "a blue bird", "id": "bird", "seed": 3}, PromptRequest("a cat", id="cat")]
    job = client.submit(items, shard_size=2, batch_size=2, **BENCH)
    said: list[str] = []
    st = job.wait(timeout=120, poll=0.5, on_no_worker=said.append)
    assert said == []  # a live worker serves the job's queue: nothing to say
    assert st.finished and st.done == 3 and st.quarantined == 0
    res = job.results()
    assert sorted(res.images) == ["000000", "bird", "cat"] and res.missing == []
    before = (tmp_path / "store" / "jobs" / job.id / "images" / "bird.png").read_bytes()
    # the same prompts and settings from code are the same job: nothing rendered again
    again = client.submit(iter(items), shard_size=2, batch_size=2, **BENCH)
    assert again.id == job.id and again.status().done == 3
    assert (tmp_path / "store" / "jobs" / job.id / "images" / "bird.png").read_bytes() == before
    # the prompts were stored as the job's source: resume reads them back
    assert job.resume().shards_enqueued == 0
    assert client.job(job.id).status().done == 3


def test_a_generator_of_over_a_hundred_thousand_prompts_streams_in_flat_memory(client: Client) -> None:
    def prompts(n: int, seed: int) -> Iterator[str]:
        for i in range(n):
            yield f"prompt number {i}, a landscape in the style of a {i % 97} century painter ({seed})"

    def peak_of(n: int, seed: int) -> tuple[int, int]:
        tracemalloc.start()
        job = client.submit(prompts(n, seed), pool="nobody", **TINY)  # no worker serves this pool
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return job.status().queued, peak

    peak_of(1_000, 0)  # imports and connections, once
    # Both past one pipelined batch of shards (500 shards of 64), the one thing held at once.
    small = peak_of(40_000, 1)
    large = peak_of(160_000, 2)
    assert small[0] == 40_000 and large[0] == 160_000
    # Held in memory, 120,000 more prompts would cost ~15 MiB as Python strings; streamed,
    # the peak moves by allocator noise only (seen: 0.5 to 2.1 MiB).
    assert large[1] < small[1] + 5 * 2**20, f"peak {small[1] / 2**20:.1f} MiB -> {large[1] / 2**20:.1f} MiB"


def test_a_bad_item_is_named_by_position_and_nothing_is_enqueued(client: Client, env: dict[str, str]) -> None:
    items: list[object] = ["fine", 5, {"prompt": ""}, {"prompt": "x", "steps": -1}, "also fine"]
    with pytest.raises(InputError) as err:
        client.submit(items, **TINY)  # type: ignore[arg-type]
    problems = err.value.problems
    assert any(p.startswith("prompts[1]: ") and "int" in p for p in problems), problems
    with pytest.raises(InputError) as err:
        client.submit(["fine", {"prompt": ""}, {"prompt": "x", "steps": -1}], **TINY)
    problems = err.value.problems
    assert [p.split(":")[0] for p in problems] == ["prompts[1]", "prompts[2]"], problems
    r = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    assert r.scard("rf:jobs") == 0 and r.keys("renderfleet.*") == []
    assert not (Path(env["RENDERFLEET_STORE"]) / "jobs").exists()


def test_the_guides_python_example_runs(env: dict[str, str], worker: WorkerProc, tmp_path: Path) -> None:
    guide = (REPO / "docs" / "guide.md").read_text()
    example = re.search(r"## The Python API\n.*?```python\n(.*?)```", guide, re.S)
    assert example, "the Python example of docs/guide.md is gone"
    script = tmp_path / "example.py"
    script.write_text(example.group(1))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert ": 9 images, 0 quarantined" in out.stdout and "fox " in out.stdout


def test_submit_reads_prompts_from_stdin_with_their_format(env: dict[str, str], bench_worker_proc: WorkerProc) -> None:
    def submit(data: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "renderfleet", "submit", "-", *bench(SECONDS_PER_IMAGE), *args],
            input=data,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )

    lines = '{"prompt": "a fox", "id": "fox"}\n{"prompt": "a hen"}\n'
    out = submit(lines, "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    job = out.stdout.split()[-1]
    client = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])
    assert client.job(job).wait(timeout=120, poll=0.5).done == 2
    assert sorted(client.job(job).results().images) == ["000001", "fox"]
    # the same stdin again is the same job
    again = submit(lines, "--format", "jsonl")
    assert again.stdout.split()[-1] == job and "0 shards enqueued" in again.stderr
    # problems are named by stdin's line; - needs --format
    bad = submit('{"prompt": "ok"}\n{"prompt": ""}\n', "--format", "jsonl")
    assert bad.returncode == 2 and bad.stderr.startswith("<stdin>:2: ") and "Traceback" not in bad.stderr
    missing = submit(lines)
    assert missing.returncode == 2 and "--format" in missing.stderr


def test_a_submit_without_a_model_is_refused_with_a_hint_and_enqueues_nothing(
    client: Client, env: dict[str, str], tmp_path: Path
) -> None:
    # The only model that needs no download renders noise: a production submit must name its model.
    with pytest.raises(InputError) as err:
        client.submit(["a red fox"], steps=2, size="32x32")
    assert [p.split(":")[0] for p in err.value.problems] == ["--model"]
    assert "--model tiny" in err.value.problems[0]
    (tmp_path / "p.txt").write_text("a red fox\n")
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", "submit", str(tmp_path / "p.txt"), "--size", "30x32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line.split(":")[0] for line in proc.stderr.splitlines()] == ["--size", "--model"], proc.stderr
    assert "`--model tiny`" in proc.stderr and "noise" in proc.stderr
    r = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    assert r.scard("rf:jobs") == 0 and r.keys("renderfleet.*") == []
    # RENDERFLEET_MODEL names a fleet's model once for every submit
    named = subprocess.run(
        [
            sys.executable,
            "-m",
            "renderfleet",
            "submit",
            str(tmp_path / "p.txt"),
            "--steps",
            "2",
            "--size",
            "32x32",
            "--pool",
            "nobody",
        ],
        env={**env, "RENDERFLEET_MODEL": "tiny"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert named.returncode == 0, named.stderr


def test_wait_says_at_once_that_no_live_worker_serves_the_jobs_queue_and_the_timeout_says_so(
    client: Client, bench_worker_proc: WorkerProc, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker is up, but for the default pool: nothing serves pool "nobody" of this store.
    job = client.submit(["a lighthouse"], pool="nobody", **TINY)
    said: list[str] = []
    with pytest.raises(TimeoutError) as err:
        job.wait(timeout=2, poll=0.5, on_no_worker=said.append)
    assert len(said) == 1 and "no live worker serves its queue renderfleet.nobody." in said[0], said
    assert "renderfleet worker --pool nobody" in said[0]
    assert "0/1 after 2 s; no live worker serves its queue renderfleet.nobody." in str(err.value)
    # Without a callback it is one WARNING of renderfleet.api (stderr even with no logging set up).
    with caplog.at_level("WARNING", logger="renderfleet.api"), pytest.raises(TimeoutError):
        job.wait(timeout=1.5, poll=0.5)
    warned = [r.getMessage() for r in caplog.records if r.name == "renderfleet.api"]
    assert len(warned) == 1 and "no live worker serves" in warned[0], warned
    # A worker gone without a word (SIGKILL: its registration stays) is not live once its liveness
    # lapses (renderfleet/registry.py): the default pool's job is told too.
    bench_worker_proc.kill()
    wait_for(lambda: not _store_workers(client), 60, what="the killed worker's liveness to lapse")
    other = client.submit(["a harbour"], **TINY)
    said.clear()
    with pytest.raises(TimeoutError, match=r"no live worker serves its queue renderfleet\.default\."):
        other.wait(timeout=1, poll=0.5, on_no_worker=said.append)
    assert len(said) == 1


def _store_workers(client: Client) -> dict[str, object]:
    from dispatcher.status.status import store_workers

    return store_workers(client.redis, client.store)
