"""One malformed value in Redis does not stop the autoscaler (issue 21, item 7): a worker
registration that is not JSON, one whose pid is no number, a per-minute counter that is no
integer: each skipped with a warning, the tick decided from the rest."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_identity, store_tag
from testing.fleet import base_env, cli

pytestmark = pytest.mark.integration

FLEET = """
[pools.spot]
kind = "spot"
min = 0
max = 4
"""


def test_the_autoscaler_skips_malformed_values_and_decides(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = str(tmp_path / "store")
    good = {
        "worker": "spot-good",
        "pool": "spot",
        "store": store_identity(store),
        "pid": 1,
        "host": "elsewhere",
        "load_ms": 1000,
    }
    client.hset(
        keys.WORKERS,
        mapping={
            "spot-not-json": "{not json",
            "spot-bad-pid": json.dumps({**good, "worker": "spot-bad-pid", "pid": "12; rm -rf /"}),
            "spot-good": json.dumps(good),
        },
    )
    minute = keys.pool_recent("spot", int(time.time() // keys.RECENT_BUCKET_SECONDS), store_tag(store))
    client.hset(minute, mapping={"started_images": "many", "wasted_images": 2})
    config = tmp_path / "fleet.toml"
    config.write_text(FLEET)
    env = base_env(tmp_path, redis_server.url, store, RENDERFLEET_CONFIG=str(config))
    run = cli(env, "autoscale", "--once", "--dry-run", "--json", check=False)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    tick = json.loads(run.stdout.strip().splitlines()[-1])
    assert [p["pool"] for p in tick["pools"]] == ["spot"]
    assert "rf:workers" in run.stderr  # the skipped values are named in a warning
