"""A job runs end to end through a Redis Sentinel failover that loses writes, with a worker
killed as well, and nobody types a command (issue 27, part 3; docs/design.md, "Redis failover").

Real processes on loopback: a primary ``redis-server``, a replica, three sentinels
(``testing.servers.SentinelRedis``), moto's S3, two ``renderfleet worker`` processes and
the monitor, all given one ``redis+sentinel://`` URL.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from renderfleet import redisconn
from renderfleet.spec import RenderParams, ShardMessage, images_prefix
from renderfleet.store import open_store
from testing.fleet import (
    WorkerProc,
    base_env,
    cli,
    job_status,
    pause_at,
    start_monitor,
    status_now,
    stopped,
    wait_for,
    worker_ready,
    write_prompts,
)
from testing.servers import SentinelRedis

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

PROMPTS, SHARD, BATCH = 32, 4, 2
RENDER = ["--model", "tiny", "--steps", "2", "--size", "64x64"]


@pytest.fixture
def sentinel_redis(tmp_path: Path) -> SentinelRedis:
    server = SentinelRedis(tmp_path / "redis", "sentinel-test-password").start()
    yield server  # type: ignore[misc]
    server.stop()


def cut_off_the_replica(cluster: SentinelRedis) -> None:
    """From now on the primary's writes do not reach the replica: it is stopped (it cannot
    reconnect and catch up) and its replication link closed.  SIGCONT it after the primary's kill."""
    primary = cluster.connect(cluster.ports["primary"])
    cluster.procs["replica"].send_signal(signal.SIGSTOP)
    primary.client_kill_filter(_type="replica")


def fail_over(cluster: SentinelRedis) -> None:
    """SIGCONT the cut-off replica and wait until the sentinels have made it the primary."""
    cluster.procs["replica"].send_signal(signal.SIGCONT)
    wait_for(
        lambda: cluster.primary_port() == cluster.ports["replica"],
        30,
        interval=0.1,
        what="the sentinels to promote the replica",
    )
    # ... and to see it up (it was stopped long enough to be marked down): a client finds it.
    wait_for(
        lambda: redisconn.client(cluster.url, socket_timeout=1).ping(),
        30,
        interval=0.1,
        what="a client to find the new primary",
    )


def lose_the_last_writes(cluster: SentinelRedis, seconds: float) -> int:
    """Cut the replica off from the primary for ``seconds`` while the fleet goes on writing to
    the primary, then SIGKILL the primary: the writes of that window are lost with it.  Returns
    the primary's replication offset read just before the kill (a lower bound of what it acknowledged)."""
    primary = cluster.connect(cluster.ports["primary"])
    cut_off_the_replica(cluster)
    time.sleep(seconds)
    offset = int(primary.info("replication")["master_repl_offset"])
    cluster.kill("primary")
    return offset


def test_a_job_finishes_through_a_sentinel_failover_that_loses_writes_and_a_killed_worker(
    tmp_path: Path, s3_bucket: str, sentinel_redis: SentinelRedis, procs: list
) -> None:
    cluster = sentinel_redis
    env = base_env(tmp_path, cluster.url, s3_bucket, RENDERFLEET_AUDIT_SECONDS="2")
    client = redisconn.client(cluster.url, socket_timeout=5)
    # B stops itself in its second shard (after its third batch's render), its first shard committed.
    doomed = WorkerProc({**env, **pause_at("after-render#3")}, tmp_path / "doomed.log", "--verbose")
    survivor = WorkerProc(env, tmp_path / "survivor.log", "--verbose")
    procs += [doomed, survivor]
    monitor = start_monitor(env, tmp_path / "monitor.log")
    procs.append(monitor)
    wait_for(lambda: worker_ready(client, 2), 120, what="both workers to load the model")
    job = cli(
        env,
        "submit",
        str(write_prompts(tmp_path / "p.txt", PROMPTS)),
        *RENDER,
        "--shard-size",
        str(SHARD),
        "--batch-size",
        str(BATCH),
    ).stdout.split()[-1]
    started = time.monotonic()
    wait_for(lambda: stopped(doomed.pid), 120, interval=0.05, what="the doomed worker to stop in its second shard")

    # The failover: writes acknowledged by the primary in the last 0.8 s never reach the
    # replica that sentinels promote; a worker dies at the same moment.
    old_primary = cluster.ports["primary"]
    acknowledged = lose_the_last_writes(cluster, 0.8)
    doomed.kill()
    fail_over(cluster)
    promoted = cluster.connect(cluster.ports["replica"])
    # The new primary's history forks from the old one where its copy stopped: past that, lost.
    kept = int(promoted.info("replication")["second_repl_offset"]) - 1
    assert kept < acknowledged, f"no write was lost (kept {kept}, acknowledged {acknowledged}): the test proves less"
    assert cluster.primary_port() != old_primary
    done_at_failover = status_now(env, job)["done"]
    assert done_at_failover < PROMPTS, "the job finished before the failover: nothing was tested"

    # No command typed: the survivor, the reaper and the monitor finish the job.
    wait_for(
        lambda: (s := status_now(env, job))["done"] == PROMPTS and s,
        180,
        interval=0.25,
        what="the job to finish through the failover",
    )
    finished = time.monotonic() - started
    st = job_status(env, job)
    assert (st["done"], st["quarantined"], st["total"]) == (PROMPTS, 0, PROMPTS)
    assert survivor.alive() and monitor.poll() is None
    assert "Connection to broker lost" in survivor.output()  # it did live through the failover

    # Exactly one image per prompt, and the counts are the store's.
    store = open_store(env["RENDERFLEET_STORE"])
    names = sorted(k.rsplit("/", 1)[-1] for k in store.list(images_prefix(job)))
    assert names == [f"{i:06d}.png" for i in range(PROMPTS)]
    results = cli(env, "results", job, "--json")
    res = json.loads(results.stdout)
    assert len(res["images"]) == PROMPTS and not res.get("missing") and not res.get("quarantined")
    assert "taken back" not in results.stderr  # nothing to correct: Redis's counts were the store's

    # Byte-identical to the same batches rendered here, one thread as the workers run.
    import torch

    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        renderer = Renderer(load_pipeline("tiny", device="cpu", cache_dir=tmp_path / "cache"))
        params = RenderParams(model="tiny", steps=2, width=64, height=64)
        for shard in range(PROMPTS // SHARD):
            first = shard * SHARD
            wire = [f"prompt number {i}" for i in range(first, first + SHARD)]
            msg = ShardMessage.from_dict(
                {
                    "job": job,
                    "shard": shard,
                    "params": params.to_dict(),
                    "batch_size": BATCH,
                    "queue": "q",
                    "first": first,
                    "count": SHARD,
                }
            ).with_prompts(wire)
            for _, batch in msg.batches():
                for prompt, png in zip(batch, renderer.render(list(batch)), strict=True):
                    assert store.get(f"jobs/{job}/images/{prompt.name}.png") == png, prompt.name
    finally:
        torch.set_num_threads(threads)
    rendered = sum(int(w.get("images", 0)) for w in st["workers"])  # the dead worker's are gone with Redis's copy
    print(
        f"\nfailover at {done_at_failover}/{PROMPTS} done; {acknowledged - kept} bytes of replication lost; "
        f"job finished {finished:.1f} s after submit; images rendered by the workers Redis knows: {rendered}"
    )
    assert os.environ.get("AWS_ENDPOINT_URL")


def test_the_monitor_resumes_a_job_whose_feed_template_the_failover_lost(
    tmp_path: Path, sentinel_redis: SentinelRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failover between submit's publish (replicated) and its feed template (acknowledged, then
    lost) leaves a job with pending shards that no feeder takes and no stall check sees (pending
    work is not a stall): the monitor sees the new primary and resumes it from the store."""
    from dispatcher.fleet.monitor import Monitor
    from dispatcher.jobs import enqueue
    from dispatcher.jobs.submit import SubmitOptions, submit
    from renderfleet import keys
    from renderfleet.celery_app import make_app, queue_name
    from renderfleet.settings import load_settings

    cluster = sentinel_redis
    settings = load_settings(redis_url=cluster.url, store=str(tmp_path / "store"))
    store = open_store(settings.store_url)
    client = redisconn.client(cluster.url, socket_timeout=5)
    app = make_app(cluster.url)
    queue = queue_name("hold", store.url)  # no worker serves it: nothing moves but what the monitor does
    monitor = Monitor(settings, app, client, store)
    monitor.tick()  # a monitor that knew the old primary
    start_feeding = enqueue.start_feeding

    def cut_off_then_feed(*args: object, **kwargs: object) -> None:
        assert client.wait(1, 5000) == 1  # the job and its pending shards are on the replica
        cut_off_the_replica(cluster)
        start_feeding(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(enqueue, "start_feeding", cut_off_then_feed)
    job = submit(
        str(write_prompts(tmp_path / "p.txt", 8)),
        SubmitOptions(RenderParams(model="tiny", steps=2, width=64, height=64), shard_size=2, batch_size=2),
        store=store,
        app=app,
        client=client,
        queue=queue,
    ).job
    # Acknowledged by the old primary: the template written, then every shard fed to the queue.
    assert client.hexists(keys.job(job), "feed") and client.llen(queue) == 4 and client.llen(keys.pending(job)) == 0
    cluster.kill("primary")
    fail_over(cluster)

    # What the promoted replica holds: the job, its 4 shards pending, no template, not in the
    # rotation, nothing queued; no feeder would ever take them.  Nor any of our scripts.
    assert client.script_exists(monitor.feeder._feed.sha) == [False]
    assert client.llen(keys.pending(job)) == 4 and client.llen(queue) == 0
    assert not client.hexists(keys.job(job), "feed") and client.zscore(keys.active(queue), job) is None
    wait_for(
        lambda: monitor.tick() is not None and client.llen(queue) == 4,
        30,
        interval=0.2,
        what="the monitor to resume the job and feed its shards",
    )
    assert client.hexists(keys.job(job), "feed") and client.llen(keys.pending(job)) == 0
    assert client.script_exists(monitor.feeder._feed.sha) == [True]  # NOSCRIPT, loaded, run: redis-py's Script
    monitor.tick()
    assert client.llen(queue) == 4  # each shard once


def test_a_tls_sentinel_url_reaches_the_primary_and_the_new_one_over_tls_for_redis_py_and_celery(
    tmp_path: Path,
) -> None:
    """``rediss+sentinel://``: TLS to the sentinels and the nodes, for our clients and Celery's."""
    from renderfleet.celery_app import make_app

    with SentinelRedis(tmp_path / "redis", "tls-test-password", tls=True) as cluster:
        assert cluster.url.startswith("rediss+sentinel://")
        client = redisconn.client(cluster.url, socket_timeout=5)
        app = make_app(cluster.url)
        for _ in range(2):  # on the first primary, then on the one the sentinels promote
            app.send_task("renderfleet.render_shard", args=["{}"], queue="tls-queue")
            assert client.register_script("return redis.call('LLEN', KEYS[1])")(keys=["tls-queue"]) >= 1
            if cluster.procs["primary"].poll() is None:
                cluster.kill("primary")
                fail_over(cluster)
        assert client.llen("tls-queue") == 2 and client.connection_pool.master_address[1] == cluster.ports["replica"]


def test_a_sentinel_client_closed_closes_its_connections_to_the_sentinels(sentinel_redis: SentinelRedis) -> None:
    """redis-py leaves the Sentinel's own clients to their owner: a master client made and closed
    (a ping, a status, a monitor's reconnect) must not leave a connection on each sentinel until the
    garbage collector finds it."""
    cluster = sentinel_redis
    observers = [cluster.connect(port, password=False) for port in cluster.sentinel_ports]

    def ours(before: list[set[int]]) -> list[set[int]]:
        """The clients on each sentinel now that were not there ``before`` (the observer's are), less its
        peers' links (named ``sentinel-<id>-cmd``: a sentinel on a loaded machine may link again at any time)."""
        return [
            {int(c["id"]) for c in o.client_list() if not c.get("name", "").startswith("sentinel-")} - seen
            for o, seen in zip(observers, before, strict=True)
        ]

    def all_closed(before: list[set[int]]) -> bool:
        """The server sees a closed socket at its next read: a moment on a loaded machine, not at once."""
        deadline = time.monotonic() + 5
        while ours(before) != [set(), set(), set()]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    try:
        before = [{int(c["id"]) for c in o.client_list()} for o in observers]
        client = redisconn.client(cluster.url, socket_timeout=5)
        assert client.ping() and any(ours(before))  # the master found by asking a sentinel: connected to it
        client.close()
        assert all_closed(before), ours(before)  # held here (no garbage collected), yet closed
        # Closed is not broken: a client used again asks the sentinels again (connected to them anew), so
        # the last check below closes connections this use opened, not none at all.
        assert client.ping() and any(ours(before)), ours(before)
        client.close()
        assert all_closed(before), ours(before)
    finally:
        for o in observers:
            o.close()
