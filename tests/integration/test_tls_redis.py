"""Redis with TLS and a password, end to end: workers, monitor, status, and no password shown."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from testing.fleet import TINY, WorkerProc, base_env, bench, bench_worker, cli, wait_for, worker_ready, write_prompts
from testing.servers import TlsRedis

pytestmark = pytest.mark.integration


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    server = TlsRedis(tmp_path / "tls", password=f"pw-{secrets.token_hex(12)}").start()
    yield server
    server.stop()


def test_a_job_runs_through_rediss_with_a_password_that_is_never_shown(tmp_path: Path, tls_redis: TlsRedis) -> None:
    # A worker on a bench model (testing.fleet.bench_worker): what is proved is the connection, not pixels.
    env = base_env(tmp_path, tls_redis.url, str(tmp_path / "store"), **bench_worker(0.02))
    worker = WorkerProc(env, tmp_path / "worker.log", "--verbose")
    outputs: list[str] = []
    try:
        client = redis.Redis.from_url(tls_redis.url)
        wait_for(lambda: worker_ready(client, 1), 90, what="the worker to register over TLS")
        prompts = write_prompts(tmp_path / "p.txt", 6)
        sub = cli(env, "submit", str(prompts), *bench(0.02), "--shard-size", "3")
        job = sub.stdout.split()[-1]
        outputs += [sub.stdout, sub.stderr]

        def finished() -> bool:
            st = cli(env, "status", job, "--json")
            outputs.extend([st.stdout, st.stderr])
            return bool(json.loads(st.stdout)["jobs"][0]["done"] == 6)

        wait_for(finished, 120, interval=1.0, what="the job to finish over TLS")
        mon = cli(env, "monitor", "--once")
        res = cli(env, "results", job)
        outputs += [mon.stdout, mon.stderr, res.stdout, res.stderr]
        assert len(list((tmp_path / "store" / "jobs" / job / "images").iterdir())) == 6
        registrations = [v.decode() for v in client.hvals("rf:workers")]
        outputs += registrations
    finally:
        worker.terminate()
    outputs.append(worker.output())
    logs = [p.read_text(errors="replace") for p in (tmp_path / "home").rglob("*.log")]
    assert all(tls_redis.password not in text for text in outputs + logs)


@pytest.mark.parametrize("case", ["wrong password", "untrusted certificate"])
def test_a_wrong_password_or_an_untrusted_certificate_is_one_clear_line(
    tmp_path: Path, tls_redis: TlsRedis, case: str
) -> None:
    url = (
        tls_redis.url_with("not-the-password")
        if case == "wrong password"
        else tls_redis.url_with(tls_redis.password, trusted=False)
    )
    env = base_env(tmp_path, url, str(tmp_path / "store"))
    prompts = write_prompts(tmp_path / "p.txt", 3)
    for args in (("status",), ("submit", str(prompts), *TINY)):
        out = cli(env, *args, check=False, timeout=60)
        assert out.returncode == 1, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr
        assert f"127.0.0.1:{tls_redis.port}" in lines[0] and "://***@127.0.0.1" in lines[0]
        assert tls_redis.password not in out.stderr and "not-the-password" not in out.stderr
    assert not (tmp_path / "store").exists()
