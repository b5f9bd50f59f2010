"""The monitor's metrics, a worker's own and the status JSON, scraped over HTTP and parsed by prometheus_client.

The workers serve a bench model (``testing.fleet.bench_worker``): the figures are the fleet's,
whatever renders the images.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from renderfleet.embedded import RedisServerProcess
from testing.fleet import (
    REPO,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    status_now,
    wait_for,
    worker_ready,
    write_prompts,
)
from testing.servers import FlakyS3Proxy, MotoServer, free_port
from testing.servers import http_get as get

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02


def start_monitor(env: dict[str, str], address: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "monitor", "--http", address],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, by (name, sorted labels), parsed by prometheus_client."""
    _, body = wait_for(lambda: (r := get(url))[0] == 200 and r, 30, what=url)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_metrics_and_status_json_match_the_fleet_and_survive_a_monitor_restart(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text("[pools.default]\nprice_per_hour = 3.6\nmax = 1\n")
    env = base_env(
        tmp_path,
        redis_server.url,
        str(tmp_path / "store"),
        RENDERFLEET_CONFIG=str(config),
        **bench_worker(SECONDS_PER_IMAGE),
    )
    worker = WorkerProc(env, tmp_path / "worker.log")
    port = free_port()
    monitor = start_monitor(env, f"127.0.0.1:{port}", tmp_path / "monitor.log")
    try:
        wait_for(lambda: worker_ready(redis.Redis.from_url(redis_server.url), 1), 90, what="worker")
        job = cli(
            env, "submit", str(write_prompts(tmp_path / "p.txt", 12)), *bench(SECONDS_PER_IMAGE), "--shard-size", "4"
        ).stdout.split()[-1]
        wait_for(lambda: status_now(env, job)["done"] == 12, 120, interval=0.25, what="the job")
        # a restart of the monitor loses nothing: every figure is read from Redis at scrape time
        monitor.terminate()
        monitor.wait(10)
        monitor = start_monitor(env, f"127.0.0.1:{port}", tmp_path / "monitor2.log")
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        assert samples[("renderfleet_images_rendered_total", (("pool", "default"),))] == 12
        assert samples[("renderfleet_workers_up", (("pool", "default"),))] == 1
        assert samples[("renderfleet_backlog_images", ())] == 0
        assert samples[("renderfleet_jobs", (("state", "finished"),))] == 1
        gpu = samples[("renderfleet_render_seconds_total", (("pool", "default"),))]
        assert gpu > 0 and samples[("renderfleet_cost_total", (("pool", "default"),))] == pytest.approx(gpu * 3.6 / 3600)
        # What the fleet costs its Redis: its main thread's CPU, commands, and the worker's and monitor's connections.
        assert samples[("renderfleet_redis_cpu_seconds_total", ())] > 0
        assert samples[("renderfleet_redis_commands_total", ())] > 0
        assert samples[("renderfleet_redis_connected_clients", ())] >= 3
        assert samples[("renderfleet_redis_max_clients", ())] == 10000
        assert samples[("renderfleet_redis_memory_max_bytes", ())] == 0
        status, body = get(f"http://127.0.0.1:{port}/api/status")
        data = json.loads(body)
        assert status == 200 and [j["job"] for j in data["jobs"]] == [job] and data["jobs"][0]["done"] == 12
    finally:
        monitor.terminate()
        monitor.wait(10)
        worker.kill()


def test_off_loopback_the_endpoint_needs_a_token_and_enforces_it(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    port = free_port()
    refused = subprocess.run(
        [sys.executable, "-m", "renderfleet", "monitor", "--once", "--http", f"0.0.0.0:{port}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert refused.returncode == 2 and "RENDERFLEET_HTTP_TOKEN" in refused.stderr and "Traceback" not in refused.stderr
    monitor = start_monitor({**env, "RENDERFLEET_HTTP_TOKEN": "s3cret-monitor-token"}, f"0.0.0.0:{port}", tmp_path / "m.log")
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port}/metrics")[0] in (200, 401), 30, what="the endpoint")
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 401
        assert get(f"http://127.0.0.1:{port}/api/status", token="wrong")[0] == 401
        assert get(f"http://127.0.0.1:{port}/metrics", token="s3cret-monitor-token")[0] == 200
        assert get(f"http://127.0.0.1:{port}/api/status?token=s3cret-monitor-token")[0] == 200
    finally:
        monitor.terminate()
        monitor.wait(10)


def test_a_worker_serves_its_own_metrics_and_they_agree_with_the_job_and_the_monitor(
    tmp_path: Path, redis_server: RedisServerProcess, s3_bucket: str, moto_server: MotoServer
) -> None:
    env = base_env(tmp_path, redis_server.url, s3_bucket, **bench_worker(SECONDS_PER_IMAGE))
    worker_port, monitor_port = free_port(), free_port()
    # The worker reaches S3 through a proxy that throttles its first two requests: two retries to count.
    with FlakyS3Proxy(moto_server.endpoint_url, fail_first=2) as proxy:
        worker = WorkerProc(
            {**env, "AWS_ENDPOINT_URL": proxy.url}, tmp_path / "worker.log", "--metrics-port", str(worker_port)
        )
        monitor = start_monitor(env, f"127.0.0.1:{monitor_port}", tmp_path / "monitor.log")
        try:
            wait_for(lambda: worker_ready(redis.Redis.from_url(redis_server.url), 1), 90, what="worker")
            job = cli(
                env,
                "submit",
                str(write_prompts(tmp_path / "p.txt", 10)),
                *bench(SECONDS_PER_IMAGE),
                "--shard-size",
                "4",
                "--batch-size",
                "2",
            ).stdout.split()[-1]
            wait_for(lambda: status_now(env, job)["done"] == 10, 120, interval=0.25, what="the job")
            ours = scrape(f"http://127.0.0.1:{worker_port}/metrics")
            fleet = scrape(f"http://127.0.0.1:{monitor_port}/metrics")
        finally:
            monitor.terminate()
            monitor.wait(10)
            worker.kill()
    pool = ("pool", "default")

    def images(outcome: str) -> float:
        return ours[("renderfleet_worker_images_total", (("outcome", outcome), pool))]

    assert images("rendered") == 10 == fleet[("renderfleet_images_rendered_total", (pool,))]
    assert images("failed") == images("quarantined") == images("skipped") == 0
    # shards of 4, 4 and 2 prompts in batches of 2: five batches, their GPU time the monitor's too (kept in ms)
    assert ours[("renderfleet_worker_batch_seconds_count", (pool,))] == 5
    gpu = ours[("renderfleet_worker_render_seconds_total", (pool,))]
    assert gpu > 0 and fleet[("renderfleet_render_seconds_total", (pool,))] == pytest.approx(gpu, abs=0.01)
    assert ours[("renderfleet_worker_model_load_seconds_count", (pool,))] == 1
    # The first S3 call is the job's HEAD if submit has marked the job stored by then, else an image's
    # PUT: a 503 to a HEAD has no body to say SlowDown (the class is the status's), one to a PUT says it.
    s3_retries = {
        labels[0][1]: value
        for (name, labels), value in ours.items()
        if name == "renderfleet_worker_retries_total" and ("what", "s3") in labels and value
    }
    assert sum(s3_retries.values()) == 2 and set(s3_retries) <= {"server", "throttled"}, s3_retries
    assert ours[("renderfleet_worker_lost_batches_total", (pool, ("reason", "fenced")))] == 0
    assert not any(name.startswith("renderfleet_worker_") for name, _ in fleet)  # the monitor keeps to its own
