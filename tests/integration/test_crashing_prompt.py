"""A prompt that kills its worker is found and quarantined; the rest of its shard renders (issue 45, item 4).

Before: a prompt that crashed its process (a CUDA fault, the kernel's OOM killer) took every worker
that held its shard: the lease lapsed, the reaper re-queued it, the next worker died the same way,
19 workers and 19 attempts and nothing quarantined, the job ``running`` for ever, and a kill before
the first heartbeat counted no lost time.  Now the reaper counts each holder's death per shard
(``keys.deaths``); from three on the shard's prompts are rendered one per call, each named in the
lease first, and the prompt whose workers die three times rendering it alone is quarantined with
``killed its worker 3 times``.

Real ``renderfleet worker`` processes on a bench model, a folder store; the crash is the failpoint
``render=kill(TEXT)``: the process SIGKILLs itself in the pipeline call that holds that prompt.
A new worker is started each time the last one died, as a node's supervisor or an autoscaler would.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis

from dispatcher.status.status import results
from renderfleet import failpoints, keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.store import LocalStore
from testing.fleet import FAST_LEASES, WorkerProc, base_env, bench, bench_worker, cli, status_now, wait_for

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02
CRASH = "a prompt that crashes the process"
LIMIT = 3  # the default RENDERFLEET_MAX_PROMPT_FAILURES: deaths before a shard is split, then per prompt


def test_a_prompt_that_kills_its_worker_is_quarantined_after_bounded_deaths_and_the_rest_renders(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc]
) -> None:
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store), **bench_worker(SECONDS_PER_IMAGE))
    client = redis.Redis.from_url(redis_server.url)
    prompts = [f"prompt number {i}" for i in range(6)]
    prompts[3] = CRASH
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in prompts))
    job = cli(env, "submit", str(tmp_path / "prompts.txt"), *bench(SECONDS_PER_IMAGE), "--batch-size", "2").stdout.split()[
        -1
    ]

    # Each worker dies in the pipeline call that holds the crashing prompt; the next one is started
    # once it is gone.  A bound on the workers, not on the clock: the old code never stops killing.
    deaths = 0
    bound = 2 * LIMIT + 2
    while True:
        worker = WorkerProc({**env, failpoints.VARIABLE: f"render=kill({CRASH})"}, tmp_path / f"w{deaths}.log")
        procs.append(worker)

        def over(w: WorkerProc = worker) -> bool:
            st = status_now(env, job)
            return not w.alive() or st["done"] + st["quarantined"] == st["total"]

        wait_for(over, 120, interval=0.25, what="the worker to die or the job to finish")
        if worker.alive():
            break
        deaths += 1
        st = status_now(env, job)
        assert deaths <= bound, f"{deaths} workers killed: {st['done']} done, {st['quarantined']} quarantined"

    # Exactly the bound the design gives: LIMIT deaths of whole batches, then LIMIT of the prompt alone.
    assert deaths == 2 * LIMIT, deaths
    st = status_now(env, job)
    assert (st["done"], st["quarantined"], st["total"]) == (5, 1, 6), st
    res = results(LocalStore(store), job)
    assert res.quarantined == {"000003": f"killed its worker {LIMIT} times"}, res.quarantined
    assert sorted(res.images) == [f"{i:06d}" for i in range(6) if i != 3]
    out = worker.output()
    assert "rendered one at a time" in out and "Traceback" not in out, out[-3000:]

    # Every death counted, on the shard and on the prompt rendered alone; none on another prompt.
    counted = {keys.text(k): int(v) for k, v in client.hgetall(keys.deaths(job)).items()}
    assert counted == {"0": 2 * LIMIT, "p3": LIMIT}, counted
    # The time each dead lease cost, from its claim (or last figure) to its lapse: at least a lease each,
    # whenever in the batch the kill came (before: 0 for a kill before the first heartbeat).
    stats = {keys.text(k): int(v) for k, v in client.hgetall(keys.job_stats(job)).items()}
    lapsed = sum(v for k, v in stats.items() if k.startswith("lapsed_ms."))
    lease_ms = int(float(FAST_LEASES["RENDERFLEET_LEASE_SECONDS"]) * 1000)
    assert lapsed >= deaths * lease_ms, stats
    assert int(client.hget(keys.FLEET_STATS, "lapsed_ms") or 0) == lapsed
    record = json.loads((store / "jobs" / job / "quarantine" / "000003.json").read_bytes())
    assert record["failures"] == LIMIT and record["prompt"] == CRASH, record
