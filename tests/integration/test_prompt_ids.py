"""Every valid prompt id works in every store: no internal mark of a store can collide with one.

The folder store once wrote each object through ``.<name>.rf-tmp-<random>``
beside it and hid every name holding ``.rf-tmp-`` from its listings: a prompt
whose id held that mark was rendered and stored, yet ``results`` reported it
missing and every ``resume`` enqueued its shard again.  The worker serves a bench model
(``testing.fleet.bench_worker``): what is proved is the store's names, not pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from renderfleet.embedded import RedisServerProcess
from renderfleet.store import TEMP_MARK
from testing.fleet import WorkerProc, base_env, bench, bench_worker, cli, job_status, status_now, wait_for

pytestmark = pytest.mark.integration

IDS = [f"a{TEMP_MARK}b", f"x{TEMP_MARK}", "plain", f"p{TEMP_MARK}.png"]


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_a_prompt_id_holding_the_old_temp_mark_is_rendered_listed_and_not_enqueued_again(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc], kind: str, request: pytest.FixtureRequest
) -> None:
    store = str(tmp_path / "store") if kind == "folder" else request.getfixturevalue("s3_bucket")
    env = base_env(tmp_path, redis_server.url, store, **bench_worker(0.02))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": name, "prompt": f"prompt {name}"}) + "\n" for name in IDS))
    job = cli(env, "submit", str(prompts), *bench(0.02), "--shard-size", "2", "--batch-size", "2").stdout.split()[-1]
    procs.append(WorkerProc(env, tmp_path / "worker.log", "--batch-size", "1"))
    wait_for(lambda: status_now(env, job)["done"] == len(IDS), 180, interval=0.25, what="the job")

    res = json.loads(cli(env, "results", job, "--json").stdout)
    assert sorted(res["images"]) == sorted(IDS) and res["missing"] == [], res
    resumed = cli(env, "resume", job)
    assert "0 shards enqueued" in resumed.stderr, resumed.stderr
    st = job_status(env, job)
    assert (st["done"], st["queued"], st["in_flight"]) == (len(IDS), 0, 0), st
