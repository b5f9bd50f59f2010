"""A symbolic link planted in a folder store reaches nothing outside it, through the real programs.

Whoever can write to the store's folder can plant a link among a job's
objects.  Served by the real ``renderfleet monitor --http``, a link to the
embedded server's password file (as an image, or a linked ``images/``
folder) is a 404, never its bytes, and the gallery does not list it; a
linked ``thumbs/`` gets nothing written through it (the thumbnail is still
served); and ``renderfleet delete`` of a job whose folder is a link removes
the link, never what it points at.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from PIL import Image

from renderfleet.embedded import RedisServerProcess
from testing.fleet import REPO, base_env, cli, wait_for
from testing.servers import free_port
from testing.servers import http_get as get

pytestmark = pytest.mark.integration

SECRET = b'{"url": "redis://:hunter2-the-password@127.0.0.1:6379/0"}'


def submit(env: dict[str, str], tmp: Path, name: str) -> str:
    (tmp / f"{name}.txt").write_text("".join(f"a lighthouse, study {name}{i}\n" for i in range(4)))
    return cli(
        env, "submit", str(tmp / f"{name}.txt"), "--model", "tiny", "--steps", "2", "--size", "32x32", "--shard-size", "4"
    ).stdout.split()[-1]


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (40, 90, 160)).save(buf, format="PNG")
    return buf.getvalue()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextmanager
def monitor(env: dict[str, str], log: Path) -> Iterator[str]:
    """The real ``renderfleet monitor --http`` on a free loopback port: its base URL."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "monitor", "--http", f"127.0.0.1:{port}"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(f"{base}/api/status")[0] == 200, 60, what="the endpoint")
        yield base
    finally:
        proc.terminate()
        proc.wait(20)
    assert "Traceback" not in log.read_text()


def test_the_monitor_serves_no_file_through_a_link_among_the_images_or_a_linked_images_folder(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store))
    secrets = tmp_path / "home-of-the-user"  # the embedded server's password file, cloud credentials
    secrets.mkdir()
    (secrets / "server.json").write_bytes(SECRET)
    (secrets / "000001.png").write_bytes(SECRET)
    # Job a: a link among its real images.
    a = submit(env, tmp_path, "a")
    images = store / "jobs" / a / "images"
    images.mkdir(parents=True, exist_ok=True)
    (images / "000000.png").write_bytes(png())
    (images / "000001.png").symlink_to(secrets / "server.json")
    # Job b: its images/ folder itself a link.
    b = submit(env, tmp_path, "b")
    assert b != a and not (store / "jobs" / b / "images").exists()
    (store / "jobs" / b / "images").symlink_to(secrets)
    with monitor(env, tmp_path / "monitor.log") as base:
        for job in (a, b):
            for path in (f"/jobs/{job}/images/000001", f"/jobs/{job}/thumbs/000001", f"/api/jobs/{job}/images/000001"):
                status, body = get(base + path)
                assert status == 404 and b"hunter2" not in body, (path, status, body[:200])
        assert json.loads(get(f"{base}/api/jobs/{a}")[1])["images"] == ["000000"]  # the link is not listed
        assert json.loads(get(f"{base}/api/jobs/{b}")[1])["images"] == []
        assert get(f"{base}/jobs/{a}/images/000000") == (200, png())  # the real image beside it still is
    assert snapshot(secrets) == {"000001.png": SECRET, "server.json": SECRET}


def test_the_monitor_writes_no_thumbnail_through_a_linked_thumbs_folder_and_still_shows_it(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store))
    outside = tmp_path / "outside"
    outside.mkdir()
    job = submit(env, tmp_path, "t")
    (store / "jobs" / job / "images").mkdir(parents=True, exist_ok=True)
    (store / "jobs" / job / "images" / "000000.png").write_bytes(png())
    (store / "jobs" / job / "thumbs").symlink_to(outside)
    with monitor(env, tmp_path / "monitor.log") as base:
        for _ in range(2):  # made, not kept: made again on the next view
            status, body = get(f"{base}/jobs/{job}/thumbs/000000")
            assert status == 200 and body[8:12] == b"WEBP"
            status, body = get(f"{base}/api/jobs/{job}/images/000000")
            assert status == 200 and json.loads(body)["size"] == "32x32"
    assert snapshot(outside) == {}
    assert "not kept in the store" in (tmp_path / "monitor.log").read_text()


def test_delete_of_a_job_whose_folder_is_a_link_removes_the_link_never_what_it_points_at(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store))
    job = submit(env, tmp_path, "p")
    # Someone with write access to the store moves the job's folder away and links its name to a home
    # folder that even looks like a job (a spec.json): the delete must not walk into it.
    victim = tmp_path / "home-of-the-user"
    (store / "jobs" / job).rename(victim)
    (victim / "precious" / "deeper").mkdir(parents=True)
    (victim / "precious" / "deeper" / "thesis.tex").write_bytes(b"years of work")
    (victim / ".aws").mkdir()
    (victim / ".aws" / "credentials").write_bytes(SECRET)
    (store / "jobs" / job).symlink_to(victim)
    before = snapshot(victim)
    out = cli(env, "delete", job, "--yes", timeout=180)
    assert f"job {job} deleted" in out.stderr, out.stderr
    assert snapshot(victim) == before  # not one file removed or written (no cancelled marker either)
    assert not (store / "jobs" / job).is_symlink() and not (store / "jobs" / job).exists()
