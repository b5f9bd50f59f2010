"""``status`` as a user reads it: at 80 columns and piped, short ids typed back, one JSON job object, costs.

Jobs are registered through the real submit path (a tiny prompt file, no worker):
Redis and the store hold what a fleet's would, and nothing renders.  Where a test
needs figures a worker would have written (GPU time, prompts counted), it writes
them into the same Redis keys a worker's commit writes.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from dispatcher.status.status import fleet_status
from dispatcher.views.http import serve
from renderfleet import Client, keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import InputError
from renderfleet.spec import store_identity, store_tag
from renderfleet.store import open_store
from testing.fleet import REPO, TINY, base_env, cli, write_prompts
from testing.manyjobs import add_jobs
from testing.servers import http_get

pytestmark = pytest.mark.integration


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"), COLUMNS="80")


def submit(env: dict[str, str], tmp: Path, n: int, *args: str) -> str:
    path = write_prompts(tmp / f"p{n}-{len(list(tmp.iterdir()))}.txt", n, prefix=f"p{n}{args}")
    return cli(env, "submit", str(path), *TINY, "--shard-size", "4", *args).stdout.split()[-1]


def shown_ids(text: str) -> list[str]:
    """The job column of the jobs table: the first word of each line after its header (up to the line
    that counts the jobs not listed)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("job "))
    out = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("+"):
            break
        out.append(line.split()[0])
    return out


def test_status_at_80_columns_piped_shows_whole_short_ids_that_every_command_takes_back(
    tmp_path: Path, env: dict[str, str]
) -> None:
    jobs = [submit(env, tmp_path, n) for n in (3, 5, 6)]
    jobs += [
        submit(env, tmp_path, 2, "--job", "nightly-run-2026-12-01"),
        submit(env, tmp_path, 4, "--job", "nightly-run-2026-12-02"),
    ]
    shown = cli(env, "status")  # piped: stdout is not a terminal
    text = shown.stdout
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text and "..." not in text
    ids = shown_ids(text)
    assert len(ids) == len(jobs)
    for short in ids:  # each a prefix of exactly one job, git's seven hex digits at least
        [full] = [job for job in jobs if job.startswith(short)]
        assert len(short) >= 9 or short == full
    assert {"nightly-run-2026-12-01", "nightly-run-2026-12-02"} <= set(ids)  # they differ in the last digit
    assert [len(s) for s in ids if s.startswith("j-")] == [9, 9, 9]
    # the columns that do not fit are named, and --wide shows them
    assert "not shown at 80 columns" in text and "--wide" in text
    wide = cli(env, "status", "--wide").stdout
    for header in ("progress", "running", "shards p/q/r", "prio/share", "redelivered/lost", "GPU s", "per 1k img"):
        assert header in wide
    assert "not shown" not in wide and max(len(line) for line in wide.splitlines()) > 80

    # every command that takes a JOB takes the short id back
    for short in ids:
        [full] = [job for job in jobs if job.startswith(short)]
        assert json.loads(cli(env, "status", short, "--json").stdout)["jobs"][0]["job"] == full
    short, full = next((s, j) for s in ids for j in jobs if j.startswith(s) and s != j)
    assert shown_ids(cli(env, "status", short).stdout) == [short]
    listed = json.loads(cli(env, "results", short, "--json", check=False).stdout)
    assert listed["job"] == full and len(listed["missing"]) > 0
    assert cli(env, "cancel", short).stdout.strip() == full
    assert json.loads(cli(env, "status", full, "--json").stdout)["jobs"][0]["state"] == "cancelled"
    assert cli(env, "resume", short).stdout.strip() == full
    assert cli(env, "delete", short, "--yes").stdout.strip() == full
    gone = cli(env, "status", full, "--json", check=False)  # a deleted job: the same layout, its state says so
    assert gone.returncode == 1 and json.loads(gone.stdout)["jobs"] == [
        {"job": full, "state": "deleted", "deleted": pytest.approx(time.time(), abs=600), "reason": "renderfleet delete"}
    ]
    client = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])
    other = next(j for j in jobs if j.startswith("j-") and j != full)
    assert client.job(other[:9]).id == other


def test_an_ambiguous_prefix_names_the_candidates_and_changes_nothing(tmp_path: Path, env: dict[str, str]) -> None:
    a = submit(env, tmp_path, 2, "--job", "batch-a")
    b = submit(env, tmp_path, 3, "--job", "batch-b")
    for args in (["status"], ["status", "--json"], ["results"], ["resume"], ["cancel"], ["delete", "--yes"]):
        proc = cli(env, *args[:1], "batch", *args[1:], check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "ambiguous" in proc.stderr and a in proc.stderr and b in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    proc = cli(env, "status", "ba", check=False)  # a prefix too short to take
    assert proc.returncode == 2 and "at least 4 characters" in proc.stderr
    proc = cli(env, "status", "nothing-like-it", check=False)
    assert proc.returncode == 1 and "no job named 'nothing-like-it'" in proc.stderr and "Traceback" not in proc.stderr
    client = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])
    with pytest.raises(InputError, match="ambiguous"):
        client.job("batch")
    assert client.job("batch-b").id == b and client.job(a).total == 2
    # nothing was cancelled or deleted by the refused commands
    states = {j["job"]: j["state"] for j in json.loads(cli(env, "status", "--json").stdout)["jobs"]}
    assert states == {a: "running", b: "running"}


def test_one_json_job_object_for_status_status_job_the_api_and_python(tmp_path: Path, env: dict[str, str]) -> None:
    job = submit(env, tmp_path, 5)
    listing = json.loads(cli(env, "status", "--json").stdout)
    single = json.loads(cli(env, "status", job, "--json").stdout)
    assert set(listing) == set(single)  # one layout: the fleet, and its jobs
    [from_listing], [from_single] = listing["jobs"], single["jobs"]
    assert set(from_listing) == set(from_single)
    assert from_listing["failure_reasons"] is None and from_single["failure_reasons"] == {}  # read when named
    for obj in (from_listing, from_single):
        assert obj["quarantined"] == 0 and "failed" not in obj and obj["state"] == "running" and obj["left"] == 5
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    store = open_store(env["RENDERFLEET_STORE"])
    endpoint = serve("127.0.0.1:0", lambda: fleet_status(client, store=store), {}, None, client=client, store=store)
    try:
        base = f"http://127.0.0.1:{endpoint.server_port}"
        code, body = http_get(f"{base}/api/status")
        assert code == 200 and set(json.loads(body)["jobs"][0]) == set(from_listing)
        code, body = http_get(f"{base}/api/jobs/{job}")
        assert code == 200 and set(json.loads(body)["job"]) == set(from_single)
        code, body = http_get(f"{base}/api/jobs/{job[:9]}")  # the page takes a short id too
        assert code == 200 and json.loads(body)["job"]["job"] == job
    finally:
        endpoint.shutdown()
    api = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"]).job(job)
    assert set(api.status().to_dict()) == set(from_single) and api.status().quarantined == api.status().failed == 0
    assert api.report().to_dict()["failure_reasons"] == {}


def test_status_job_and_its_json_show_the_model_size_steps_scheduler_and_negative_prompt(
    tmp_path: Path, env: dict[str, str]
) -> None:
    job = submit(env, tmp_path, 5, "--scheduler", "euler_a", "--negative", "blurry, low quality")
    plain = submit(env, tmp_path, 3)
    [obj] = json.loads(cli(env, "status", job, "--json").stdout)["jobs"]
    assert (obj["model"], obj["size"], obj["steps"]) == ("tiny", "32x32", 2)
    assert (obj["scheduler"], obj["negative_prompt"]) == ("euler_a", "blurry, low quality")
    shown = job[:9]
    wide = {**env, "COLUMNS": "200"}  # at 80 the line folds
    text = cli(wide, "status", shown).stdout
    assert f'job {shown}: tiny at 32x32, 2 steps, scheduler euler_a, negative prompt "blurry, low quality"' in text
    text = cli(wide, "status", plain).stdout
    assert "tiny at 32x32, 2 steps, the model's own scheduler, no negative prompt" in text
    # The listing of every job keeps to its table: the settings are the one-job view's.
    assert "negative prompt" not in cli(wide, "status").stdout
    # A job Redis does not know: the same figures, from its spec in the store.
    redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]).flushall()
    [gone] = json.loads(cli(env, "status", job, "--json").stdout)["jobs"]
    assert gone["known_to_redis"] is False and (gone["model"], gone["scheduler"]) == ("tiny", "euler_a")


def test_status_watch_piped_prints_a_frame_at_once_then_every_two_seconds(tmp_path: Path, env: dict[str, str]) -> None:
    job = submit(env, tmp_path, 3)
    # Tests started as a background job (`make test &` in a script) inherit SIGINT ignored, and so would
    # the watch, which Ctrl-C could then not stop: it gets the default (handlers, unlike SIG_IGN, are not
    # inherited). PYTHONFAULTHANDLER: should it not stop, SIGABRT makes it print where its threads are.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "status", "--watch"],
            env={**env, "PYTHONFAULTHANDLER": "1"},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    out = b""
    try:
        deadline = time.monotonic() + 60  # the CLI's start-up on a loaded machine, not a timing assertion
        while out.count(b"-- status at") < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                out += os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
        text = out.decode()
        assert text.count("-- status at") >= 2, text
        assert job[:9] in text and "\x1b[" not in text  # plain text: no cursor moves or colours
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)  # Ctrl-C ends the watch; a loaded machine may take a while to tear down
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)  # its threads' stacks on stderr (faulthandler)
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
            raise AssertionError(
                f"status --watch did not stop on SIGINT; {out.count(b'-- status at')} frame(s) "
                f"seen; its stderr:\n{err.decode(errors='replace')[-6000:]}"
            ) from None


def count(client: redis.Redis, job: str, done: int, quarantined: int, gpu_ms: dict[str, int]) -> None:
    """What workers' commits would have written: prompts done and quarantined, GPU time by pool."""
    for i in range(done):
        client.setbit(keys.done_bits(job), i, 1)
    for i in range(done, done + quarantined):
        client.setbit(keys.failed_bits(job), i, 1)
    for pool, ms in gpu_ms.items():
        client.hset(keys.job_stats(job), f"render_ms.{pool}", ms)


def test_prices_published_by_the_fleet_price_status_without_config_never_rounded_to_zero(
    tmp_path: Path, env: dict[str, str]
) -> None:
    cheap = submit(env, tmp_path, 12)
    unpriced = submit(env, tmp_path, 4, "--pool", "spare")
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    count(client, cheap, 10, 0, {"default": 3600})  # 3.6 GPU-seconds for 10 images
    count(client, unpriced, 2, 0, {"spare": 1000})
    before = json.loads(cli(env, "status", "--json").stdout)
    assert before["prices"] == {} and all(j["cost"] is None for j in before["jobs"])

    # a monitor given the config publishes its pools' prices; status then needs no --config
    config = tmp_path / "fleet.toml"
    config.write_text("[pools.default]\nprice_per_hour = 0.5\nmax = 1\n\n[pools.spare]\nmax = 1\n")
    cli({**env, "RENDERFLEET_CONFIG": str(config)}, "monitor", "--once")
    assert client.hgetall(keys.prices(store_tag(env["RENDERFLEET_STORE"]))) == {b"default": b"0.5"}
    after = {j["job"]: j for j in json.loads(cli(env, "status", "--json").stdout)["jobs"]}
    assert after[cheap]["cost"] == pytest.approx(3.6 * 0.5 / 3600)  # 0.0005
    assert after[cheap]["cost_per_1000_images"] == pytest.approx(0.05)
    assert after[unpriced]["cost"] is None  # a pool with no price has no cost, not a cost of 0
    text = cli(env, "status", "--wide").stdout
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("j-",))}
    assert rows[cheap[:9]][-2:] == ["0.0005", "0.05"]  # cost, per 1,000 images: never 0.00
    assert rows[unpriced[:9]][-2:] == ["-", "-"]
    # the autoscaler publishes its pools' prices at each decision (max 0: it starts no worker here)
    config.write_text("[pools.default]\nprice_per_hour = 0.75\nmax = 0\n")
    cli({**env, "RENDERFLEET_CONFIG": str(config)}, "autoscale", "--once")
    assert client.hget(keys.prices(store_tag(env["RENDERFLEET_STORE"])), "default") == b"0.75"
    # --config still overrides what was published
    config.write_text("[pools.default]\nprice_per_hour = 5\nmax = 1\n")
    over = json.loads(cli(env, "status", cheap, "--json", "--config", str(config)).stdout)["jobs"][0]
    assert over["cost"] == pytest.approx(3.6 * 5 / 3600)


def test_a_job_all_quarantined_is_a_red_bar_not_a_green_one(tmp_path: Path, env: dict[str, str]) -> None:
    job = submit(env, tmp_path, 12)
    count(redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]), job, 0, 12, {})
    assert "renderfleet status --all" not in cli(env, "status").stdout  # failed, not finished: never folded
    text = cli(env, "status", "--all", "--wide").stdout
    [row] = [line for line in text.splitlines() if line.startswith(job[:9])]
    assert re.search(r"\bx{10}\b", row) and "#" not in row  # piped: quarantined x, rendered #
    assert row.split()[4:7] == ["xxxxxxxxxx", "0/12", "12"]  # after its name (its file's), age and prio/share
    [obj] = json.loads(cli(env, "status", job, "--json").stdout)["jobs"]
    # ...and failed, never done: its ETA cell says so, its reason once (issue 37)
    assert (obj["done"], obj["quarantined"], obj["state"], obj["eta_seconds"]) == (0, 12, "failed", None)
    assert obj["failure"].startswith("every prompt (12) was quarantined")
    assert "failed" in row and "done" not in row.split()[4:]
    assert " ".join(text.split()).count("every prompt (12) was quarantined") == 1


def test_a_few_finished_jobs_are_listed_and_a_fourth_folds_them(tmp_path: Path, env: dict[str, str]) -> None:
    # Issue 46 item 9: the README's first `status` shows the job `make run` rendered, finished; a fleet of
    # finished jobs is counted in one line.
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    store = open_store(env["RENDERFLEET_STORE"])
    done = add_jobs(client, store, 3)
    live = add_jobs(client, store, 2, prefix="live", finished=False)  # two: each id shown whole, as typed here
    text = cli(env, "status").stdout
    assert shown_ids(text) == live + done and "finished: renderfleet status --all" not in text, text
    add_jobs(client, store, 4)  # done-00000 to done-00003: one more
    text = cli(env, "status").stdout
    assert shown_ids(text) == live and "+4 finished: renderfleet status --all" in text, text


def test_status_of_many_finished_jobs_folds_them_into_one_line_and_reads_only_their_counters(
    tmp_path: Path, env: dict[str, str]
) -> None:
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    store = open_store(env["RENDERFLEET_STORE"])
    add_jobs(client, store, 200)
    live = add_jobs(client, store, 2, prefix="live", finished=False)
    client.config_resetstat()
    text = cli(env, "status").stdout
    calls = {name: stat["calls"] for name, stat in client.info("commandstats").items()}
    assert shown_ids(text) == live  # the active jobs, and the finished ones...
    assert "+200 finished: renderfleet status --all" in text and len(text.splitlines()) < 30, text
    # ...counted from their hash and done bits: neither their progress, shards nor attempts are read
    assert calls.get("cmdstat_lrange", 0) == len(live) and calls.get("cmdstat_hvals", 0) == len(live), calls
    assert "queues of store" in text
    every = cli(env, "status", "--all").stdout
    assert shown_ids(every) == live + [f"done-{i:05d}" for i in range(200)]  # active first
    assert "finished: renderfleet status --all" not in every
    assert len(json.loads(cli(env, "status", "--json").stdout)["jobs"]) == 202  # the JSON lists every job


# CI (.ci/run) sets RENDERFLEET_REQUIRE_TMUX: there a missing tmux fails this test instead of skipping it.
@pytest.mark.skipif(
    shutil.which("tmux") is None and not os.environ.get("RENDERFLEET_REQUIRE_TMUX"),
    reason="needs tmux: a terminal of 80 x 24 to watch in (make terminal installs it)",
)
def test_status_watch_in_an_80_by_24_terminal_with_12_jobs_keeps_the_queues_and_workers_on_screen(
    tmp_path: Path, env: dict[str, str]
) -> None:
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    store = open_store(env["RENDERFLEET_STORE"])
    add_jobs(client, store, 4)
    add_jobs(client, store, 8, prefix="live", finished=False)
    info = {"worker": "w-on-screen", "pool": "default", "store": store_identity(store.url), "model": "tiny"}
    client.hset(keys.WORKERS, "w-on-screen", json.dumps({**info, "device": "cpu", "queues": ["default"]}))
    client.hset(keys.worker_stats("w-on-screen"), "last_seen", f"{time.time() + 3600:.3f}")
    script = tmp_path / "watch.sh"
    exports = "".join(f"export {k}={json.dumps(v)}\n" for k, v in env.items() if k.isidentifier())
    script.write_text(f"{exports}unset COLUMNS LINES\ncd {REPO}\nexec {sys.executable} -m renderfleet status --watch\n")
    socket = f"rf-watch-{os.getpid()}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    subprocess.run([*tmux, "new-session", "-d", "-x", "80", "-y", "24", f"bash {script}"], check=True)
    try:
        screen, deadline = "", time.monotonic() + 60  # the CLI's start-up on a loaded machine
        while "w-on-screen" not in screen and time.monotonic() < deadline:
            time.sleep(1)
            screen = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True).stdout
        lines = screen.rstrip("\n").splitlines()
        assert "w-on-screen" in screen and any(line.startswith("workers") for line in lines), screen
        assert any(line.startswith("queues of store") for line in lines), screen
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), screen
        shown = [line.split()[0] for line in lines if line.startswith("live-")]
        assert shown and shown == [f"live-{i:05d}" for i in range(len(shown))], screen  # the active jobs first
        folded = f"+{8 - len(shown)} more active, +4 finished" if len(shown) < 8 else "+4 finished"
        assert f"{folded}: renderfleet status --all" in screen, screen
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
