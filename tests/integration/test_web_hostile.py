"""The monitor's web server under hostile or heavy use: the real ``renderfleet monitor --http`` in a subprocess.

- A malformed value in any Redis key the page reads is skipped with one
  warning; every page, ``/metrics`` and ``renderfleet status`` still answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from testing.fleet import REPO, base_env, cli, wait_for
from testing.servers import free_port
from testing.servers import http_get as get

pytestmark = pytest.mark.integration


def start_monitor(env: dict[str, str], address: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "renderfleet", "monitor", "--http", address], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def submit(env: dict[str, str], tmp: Path, n: int, size: str = "32x32") -> str:
    (tmp / "p.txt").write_text("".join(f"a lighthouse, study {i}\n" for i in range(n)))
    return cli(env, "submit", str(tmp / "p.txt"), "--model", "tiny", "--steps", "2", "--size", size,
               "--shard-size", "4").stdout.split()[-1]


def test_a_malformed_redis_value_is_skipped_once_and_every_page_and_status_still_answer(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    job = submit(env, tmp_path, 8)
    client = redis.Redis.from_url(redis_server.url)
    client.hset(keys.WORKERS, mapping={
        "w-good": json.dumps({"worker": "w-good", "pool": "default", "model": "tiny"}),
        "w-text": "not json", "w-list": "[1, 2]", "w-nan": '{"pool": NaN}', "w-huge": '{"pool": 1e999}',
        "w-deep": "[" * 100_000 + "]" * 100_000, "w-bytes": b"\xff\xfe",
    })
    client.hset(keys.worker_stats("w-good"), mapping={"since": "soon", "images": "many"})
    client.hset(keys.pool_stats("default"), mapping={"images": "many", "render_ms": "1e3", "batches": "12",
                                                     "mps_milli": str(2**70)})
    client.hset(keys.DESIRED, mapping={"default": "two", "spot": "1"})
    client.hset(keys.FLEET_STATS, "reaped", "x")
    client.lpush(keys.history("queue_shards"), "nan nan", "1 inf", "garbage", b"\xff 1")
    client.hset(keys.job(job), mapping={"spec": "{not json", "total": "lots"})
    client.hset(keys.job_stats(job), mapping={"render_ms.default": "x", "wasted_images": "1.5"})
    client.lpush(keys.progress(job), "abc", "1 0", "nan 3", f"1 {'9' * 30}")
    client.hset(keys.attempts(job), "0", "x")
    client.hset(keys.left(job), "0", "x")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "monitor.log"
    monitor = start_monitor(env, f"127.0.0.1:{port}", log)
    try:
        wait_for(lambda: get(f"{base}/api/status")[0] != 0, 60, what="the endpoint")
        for _ in range(3):  # the page polls: each skipped value is logged once, not at every read
            for path in ("/", "/api/status", "/metrics", "/api/autoscale", f"/jobs/{job}", f"/api/jobs/{job}"):
                status, body = get(base + path)
                assert status == 200, (path, body[:500])
        data = json.loads(get(f"{base}/api/status")[1])
        assert [w["worker"] for w in data["workers"]] == ["w-good"]
        assert data["pools"]["default"] == {"batches": 12} and data["desired"] == {"spot": 1}
        assert data["leases_reaped"] == 0 and [j["job"] for j in data["jobs"]] == [job]
        for args in (["status"], ["status", "--json"], ["status", job]):
            done = cli(env, *args)
            assert "Traceback" not in done.stderr, done.stderr
        text = log.read_text()
        assert "Traceback" not in text
        assert text.count("skipping a malformed value in Redis at rf:workers b'w-text'") == 1
        assert text.count(f"at {keys.pool_stats('default')} images: not a 64-bit integer") == 1
        assert f"at {keys.job(job)} spec" in text and f"at {keys.progress(job)}" in text
    finally:
        stop(monitor)
