"""The short chaos run in `make test-slow`: kills, a spot notice, a worker paused past its lease, a kill
between a message's fetch and its claim, a Redis restart with every worker mid-shard, and a poison
job beside the good one, and an urgent two-stage job (upscale, refine) at a higher priority behind it;
every image exactly once, byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import BATCH_SIZE, run_chaos

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow]

PROMPTS = 320
WORKERS = 3
POISON = 4
URGENT = 8


@pytest.mark.timeout(600)  # the run's own limit is 400 s; its setup (the reference renders) comes on top
def test_every_prompt_lands_once_byte_identical_through_kills_pauses_lost_messages_a_restart_and_a_poison_job(
    tmp_path: Path,
) -> None:
    report = run_chaos(
        prompts=PROMPTS,
        workers=WORKERS,
        kills=4,
        stalls=1,
        claim_kill=True,
        poison=POISON,
        urgent=URGENT,
        timeout=400,
        workdir=tmp_path,
    )
    print(report.summary())
    assert report.missing == [] and report.extra == [] and report.mismatched == []
    assert report.images == PROMPTS and report.quarantined == 0
    assert report.status_done == PROMPTS and report.status_failed == 0
    assert report.both_done_and_failed == 0
    assert report.notice_exit_codes == [0] * report.notices
    assert report.kills >= 1 and report.redis_restarts == 1
    # The lease reaper, not Celery's visibility timeout (an hour), brings a killed worker's
    # shard back. The bound is loose on purpose: on 2 shared cores a shard also waits for a
    # free worker; bench/reclaim_bench.py measures the figure itself.
    assert report.kill_to_running and all(t < 60 for t in report.kill_to_running), report.kill_to_running

    # 1. SIGSTOP past the lease: the shard went on elsewhere; the stale worker, woken, was fenced
    #    (or had nothing left to write) and serves on; at most its batch in flight is lost.
    assert report.stalls == 1 and len(report.stall_to_claimed) == 1
    assert report.stall_outcomes[0] in ("fenced", "finished") and report.stale_alive
    assert report.stall_lost <= BATCH_SIZE
    # 2. SIGKILL between taking a message and claiming it: the monitor's audit brought it back.
    assert report.claim_kills == 1 and report.claim_kill_audited and report.claim_kill_started == 0
    assert report.claim_kill_to_running and report.claim_kill_to_running[0] < 60
    # 3. Redis restarted with every worker holding a lease; each took a new shard afterwards.
    assert report.busy_at_restart == [f"{WORKERS}/{WORKERS}"]
    assert report.restart_to_all_working and report.restart_to_all_working[0] < 60
    # 4. The poison job: its model will not load, so it failed once as a whole with the reason (issue 37),
    #    no prompt tried or stored, no worker stopped.
    assert (report.poison_done, report.poison_failed) == (0, 0) and report.poison_quarantine_ok
    assert "nonexistent-model-folder" in report.poison_failure, report.poison_failure
    assert report.breaker_exits == 0
    # 5. Two priorities on the queue: the urgent job (--priority 9, submitted after the big one) is
    #    whole and byte-identical, and was done while the big one was still rendering.
    assert report.urgent_images == report.urgent_status_done == URGENT and report.urgent_bad == []
    assert report.main_done_when_urgent_done < PROMPTS, report.summary()
    assert report.ok
