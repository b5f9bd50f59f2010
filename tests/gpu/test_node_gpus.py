"""GPU tier: a real node supervisor (``renderfleet worker --gpus all``) on every card of the machine.

What tests/integration/test_node.py cannot show on stand-in GPUs: that each worker of the node
runs on a real card and sees its own device alone (``CUDA_VISIBLE_DEVICES``), renders the built-in
``tiny`` there, and that the node still drains within its grace and leaves nothing registered.
Skipped without CUDA, as the rest of the tier.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from testing.fleet import TINY, WorkerProc, base_env, cli, job_finished, wait_for, write_prompts

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GRACE = 5.0  # the workers' RENDERFLEET_SIGTERM_GRACE_SECONDS
WITHIN = GRACE + 5.0 + 5.0  # the grace, the supervisor's margin for the hand-back (KILL_MARGIN_SECONDS), slack


def environ(pid: int) -> dict[str, str]:
    """A live process's environment, as it was started."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in raw if e)


def node_workers(env: dict[str, str]) -> list[dict[str, Any]]:
    """``status --json``'s workers of the node that have loaded their model (not ``loading``), by GPU."""
    workers = json.loads(cli(env, "status", "--json").stdout)["workers"]
    return sorted((w for w in workers if w.get("node") and w.get("state") != "loading"), key=lambda w: int(w["gpu"]))


def test_a_node_runs_a_worker_on_each_real_card_each_seeing_its_own_device_and_drains_on_sigterm(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list
) -> None:
    from worker.node.supervisor import cuda_devices

    count = torch.cuda.device_count()
    devices = cuda_devices()  # what each worker's CUDA_VISIBLE_DEVICES must be, by GPU label (its index)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_SIGTERM_GRACE_SECONDS=str(GRACE))
    client = redis.Redis.from_url(redis_server.url)
    node = WorkerProc(env, tmp_path / "node.log", "--gpus", "all", "--model", "tiny", "--verbose")
    procs.append(node)  # killed, process group and all, should the test fail
    wait_for(
        lambda: len(node_workers(env)) == count or not node.alive(),
        180,
        interval=1.0,
        what=f"the node's {count} worker(s) to load tiny and register",
    )
    assert node.alive(), node.output()[-3000:]

    # 8 prompts or more in shards of 2: two shards a GPU at least, on a node of up to 8.
    total = max(8, 4 * count)
    job = cli(
        env, "submit", str(write_prompts(tmp_path / "p.txt", total)), *TINY, "--shard-size", "2", "--batch-size", "2"
    ).stdout.split()[-1]
    st = job_finished(env, job, timeout=120)
    assert st["done"] == total and st["quarantined"] == 0, st

    data = json.loads(cli(env, "status", "--json").stdout)
    [rec] = data["nodes"]
    assert [g["gpu"] for g in rec["gpus"]] == [str(i) for i in range(count)], rec
    assert all(g["state"] == "up" for g in rec["gpus"]), rec
    workers = node_workers(env)
    assert [w["gpu"] for w in workers] == [str(i) for i in range(count)], workers
    for w in workers:
        i = int(w["gpu"])
        # A real card, named as the driver names GPU i here (not a stand-in, not the CPU), its memory too.
        assert w["device"] == "cuda" and w["card"] == torch.cuda.get_device_name(i), w
        assert w["vram_gib"] == round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1), w
        # Its own device alone: the one CUDA device its process sees is GPU i.
        assert environ(w["pid"]).get("CUDA_VISIBLE_DEVICES") == devices[i], w
        assert w["pid"] == rec["gpus"][i]["pid"], (w, rec)
    # Every image of the job counted to the node's workers (their counters are sent with their next
    # write to Redis: a moment after the last commit).
    wait_for(
        lambda: sum(int(w.get("images", 0)) for w in node_workers(env)) == total,
        30,
        interval=1.0,
        what=f"the node's workers to count {total} images",
    )
    workers = node_workers(env)
    print(
        f"\nnode of {count} GPU(s) ({workers[0]['card']}): {total} images, by GPU "
        + ", ".join(f"{w['gpu']}: {w.get('images', 0)}" for w in workers)
    )

    # SIGTERM: every worker drains within the grace, the node exits 0 and leaves no registration.
    asked = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(WITHIN) == 0, node.output()[-3000:]
    assert time.monotonic() - asked < GRACE + 5.0, node.output()[-3000:]
    assert "outlived the grace" not in node.output()
    assert client.hlen(keys.WORKERS) == 0 and client.scard(keys.NODES) == 0
    assert json.loads(cli(env, "status", "--json").stdout)["nodes"] == []
