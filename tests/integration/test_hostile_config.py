"""Hostile configuration, as a user meets it at the CLI (issue 21): a Redis URL
whose password would be misread, a shared RENDERFLEET_HOME, a server.json naming
a server renderfleet did not start.  Each is one line naming the setting, a
non-zero exit, no traceback, no secret, and nothing changed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from renderfleet.embedded import RedisServerProcess, ping
from testing.fleet import TINY, base_env, cli, write_prompts
from testing.servers import free_port

pytestmark = pytest.mark.integration

SECRET = ("Xq7", "Zk9")


def home_env(tmp_path: Path, home: Path) -> dict[str, str]:
    """The CLI's environment with the embedded server (no RENDERFLEET_REDIS_URL) under ``home``."""
    env = base_env(tmp_path, "", str(tmp_path / "store"), RENDERFLEET_HOME=str(home))
    del env["RENDERFLEET_REDIS_URL"]
    return env


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# Each URL's port is one nothing listens on ({port}, {port2}: bound to port 0, read, closed): were the
# check to let one through, no command could reach a Redis, least of all the machine's shared one on 6379.
@pytest.mark.parametrize(
    "url",
    [
        "redis://:Xq7/Zk9@127.0.0.1:{port}/0",
        "redis://:Xq7#Zk9@127.0.0.1:{port}/0",
        "redis://:Xq7?Zk9@127.0.0.1:{port}/0",
        "redis://Xq7Zk9@127.0.0.1:{port}/0",
        "redis+sentinel://:Xq7/Zk9@127.0.0.1:{port},127.0.0.1:{port2}/mymaster",  # a Sentinel URL alike
    ],
)
def test_a_redis_url_whose_password_would_be_misread_is_one_line_without_it(tmp_path: Path, url: str) -> None:
    url = url.format(port=free_port(), port2=free_port())
    env = base_env(tmp_path, url, str(tmp_path / "store"))
    prompts = write_prompts(tmp_path / "p.txt", 2)
    for args in (("status",), ("server", "url"), ("submit", str(prompts), *TINY), ("worker",)):
        out = cli(env, *args, check=False, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        line = one_line(out.stderr)
        assert line.startswith("renderfleet: RENDERFLEET_REDIS_URL: "), line
        assert not [s for s in SECRET if s in out.stdout + out.stderr], out.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "home").exists()


def test_a_shared_home_folder_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # what /tmp is
    out = cli(home_env(tmp_path, shared), "server", "start", check=False, timeout=60)
    assert out.returncode == 2
    line = one_line(out.stderr)
    assert line.startswith(f"renderfleet: RENDERFLEET_HOME: {shared} is group- or world-writable (mode 1777)"), line
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and list(shared.iterdir()) == []


def test_server_stop_refuses_a_password_protected_server_renderfleet_did_not_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    foreign = RedisServerProcess(workdir=tmp_path / "elsewhere" / "redis", password="their-Pa55word")
    foreign.start()
    try:
        pid = foreign.proc.pid if foreign.proc else 0
        (home / "server.json").write_text(json.dumps({"url": foreign.url, "pid": pid}))
        env = home_env(tmp_path, home)
        out = cli(env, "server", "stop", check=False, timeout=60)
        assert out.returncode == 2, out.stderr
        line = one_line(out.stderr)
        assert line.startswith(
            f"renderfleet: RENDERFLEET_HOME: {home / 'server.json'} names a Redis server renderfleet did not start here"
        ), line
        assert f"pid {pid}" in line and "left running" in line and "their-Pa55word" not in out.stdout + out.stderr
        assert ping(foreign.url) and (home / "server.json").exists()
        out = cli(env, "server", "url", check=False, timeout=60)
        assert out.returncode == 1 and "no server running" in out.stderr and "their-Pa55word" not in out.stdout
        # `start` starts a server of its own beside it; `stop` then stops that one only.
        mine = cli(env, "server", "start", timeout=60).stdout.strip()
        assert mine.startswith("redis://***@127.0.0.1:") and f":{foreign.port}/" not in mine
        assert cli(env, "server", "stop", timeout=60).stdout.strip() == "stopped"
        assert ping(foreign.url)
    finally:
        foreign.stop()
