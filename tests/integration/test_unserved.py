"""What ``status`` and ``Job.wait()`` say of a job no loaded worker takes: a worker of its queue is
loading its model, or no live worker serves the queue at all.  Real Redis; the registrations are
written as a worker writes them (worker/lease/loading.py), or by a real LoadingRegistration."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.api import Client
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_identity
from renderfleet.store import open_store
from testing.fleet import TINY, base_env, cli, wait_for, write_prompts
from worker.lease.loading import LoadingRegistration

pytestmark = pytest.mark.integration

NO_WORKER = "no live worker serves its queue"
START_ONE = "start one with `renderfleet worker --pool default`"
LOADING = "a worker is loading its model"


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), "COLUMNS": "400"}


def _submit(tmp_path: Path, env: dict[str, str]) -> str:
    return cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 3)), *TINY).stdout.split()[-1]


def _loading_info(tmp_path: Path) -> dict[str, object]:
    store = store_identity(open_store(str(tmp_path / "store")).url)
    return {"pool": "default", "store": store, "model": "tiny", "device": "", "host": "h", "pid": 1, "queues": ["default"]}


def _register_loading(client: redis.Redis, tmp_path: Path) -> None:
    """A registration as worker/lease/loading.py writes it while the worker loads its model."""
    info = {**_loading_info(tmp_path), "worker": "w-loading", "state": "loading", "started": time.time()}
    client.hset(keys.WORKERS, "w-loading", json.dumps(info))
    client.hset(keys.worker_stats("w-loading"), "last_seen", f"{time.time():.3f}")


def _job_json(env: dict[str, str], job: str) -> dict[str, object]:
    data = json.loads(cli(env, "status", job, "--json").stdout)
    return next(j for j in data["jobs"] if j["job"] == job)


def test_status_says_no_live_worker_serves_the_queue_and_how_to_start_one(tmp_path: Path, env: dict[str, str]) -> None:
    job = _submit(tmp_path, env)
    text = cli(env, "status", job).stdout
    assert NO_WORKER in text and START_ONE in text, text
    found = _job_json(env, job)
    assert found["unserved"] == "none"
    assert NO_WORKER in str(found["unserved_note"]) and START_ONE in str(found["unserved_note"])


def test_status_says_a_worker_is_loading_its_model_not_that_none_is_live(
    tmp_path: Path, env: dict[str, str], redis_server: RedisServerProcess
) -> None:
    job = _submit(tmp_path, env)
    _register_loading(redis.Redis.from_url(redis_server.url), tmp_path)
    text = cli(env, "status", job).stdout
    assert LOADING in text and NO_WORKER not in text, text
    assert "loading model" in text  # the workers table's "doing"
    _register_loading(redis.Redis.from_url(redis_server.url), tmp_path)  # its touch, as a loading worker keeps it
    found = _job_json(env, job)
    assert found["unserved"] == "loading" and LOADING in str(found["unserved_note"])


def test_wait_says_a_worker_is_loading_its_model_then_that_none_is_live_once_it_is_gone(
    tmp_path: Path, env: dict[str, str], redis_server: RedisServerProcess
) -> None:
    job_id = _submit(tmp_path, env)
    client = Client(redis_url=redis_server.url, store=str(tmp_path / "store"))
    told: list[str] = []
    with LoadingRegistration(redis.Redis.from_url(redis_server.url), "w-real", _loading_info(tmp_path), 0.2):
        # written by its thread, best effort: a loaded machine's first write can come after wait()'s first look
        wait_for(lambda: redis.Redis.from_url(redis_server.url).hexists(keys.WORKERS, "w-real"), 10, what="registration")
        with pytest.raises(TimeoutError, match="loading its model"):
            client.job(job_id).wait(timeout=1.0, poll=0.2, on_no_worker=told.append)
        failing = LoadingRegistration(redis.Redis.from_url(redis_server.url), "w-failed", _loading_info(tmp_path), 0.2)
        with pytest.raises(RuntimeError), failing:  # a load that fails: its registration goes with it
            raise RuntimeError("load failed")
    assert not redis.Redis.from_url(redis_server.url).hexists(keys.WORKERS, "w-failed")
    assert [LOADING in m for m in told] == [True], told
    redis.Redis.from_url(redis_server.url).hdel(keys.WORKERS, "w-real")  # as if it had died loading
    with pytest.raises(TimeoutError, match=NO_WORKER):
        client.job(job_id).wait(timeout=0.5, poll=0.2, on_no_worker=told.append)
    assert NO_WORKER in told[-1] and START_ONE in told[-1]
