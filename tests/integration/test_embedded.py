"""The embedded server: a password, private files, and no trust in a server we did not start."""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import (
    CHECKOUT,
    RedisServerProcess,
    ensure_embedded,
    ping,
    stop_embedded,
    trusted_server,
    write_private,
)
from renderfleet.errors import ConfigError
from testing.fleet import TINY, base_env, cli, start_redis, write_prompts

pytestmark = pytest.mark.integration


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_embedded_server_has_a_password_kept_in_private_files(tmp_path: Path) -> None:
    home = tmp_path / "home"
    url = ensure_embedded(home)
    try:
        password = redis.Redis.from_url(url).connection_pool.connection_kwargs["password"]
        assert password and len(password) >= 24
        port = url.rsplit(":", 1)[1].split("/")[0]
        anonymous = redis.Redis(host="127.0.0.1", port=int(port))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        assert redis.Redis.from_url(url).ping()
        # every later command finds the same server
        assert ensure_embedded(home) == url
        assert mode(home) == 0o700 and mode(home / "server.json") == 0o600
        assert mode(home / "redis") == 0o700 and mode(home / "redis" / "server.conf") == 0o600
        # not on the command line, where any local user could read it
        pid = json.loads((home / "server.json").read_text())["pid"]
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        assert stop_embedded(home)
    assert not ping(url)


def test_server_url_shows_the_password_only_when_asked(tmp_path: Path) -> None:
    env = base_env(tmp_path, "", str(tmp_path / "store"))
    del env["RENDERFLEET_REDIS_URL"]  # the embedded server, under tmp_path/home
    try:
        started = cli(env, "server", "start", timeout=60).stdout.strip()
        masked = cli(env, "server", "url").stdout.strip()
        assert "***" in started and masked == started
        full = cli(env, "server", "url", "--show-password").stdout.strip()
        # the URL a user hands to Flower or redis-cli: it opens the server renderfleet uses
        assert full == json.loads((tmp_path / "home" / "server.json").read_text())["url"]
        assert "***" not in full and redis.Redis.from_url(full).ping()
        password = redis.Redis.from_url(full).connection_pool.connection_kwargs["password"]
        assert password and password not in masked
        bad = cli(env, "server", "stop", "--show-password", check=False)
        assert bad.returncode == 2 and "--show-password" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        cli(env, "server", "stop")
    assert not ping(full)


def test_a_server_another_checkout_started_says_so_once_when_used(tmp_path: Path) -> None:
    env = base_env(tmp_path, "", str(tmp_path / "store"))
    del env["RENDERFLEET_REDIS_URL"]  # the embedded server, under tmp_path/home
    state = tmp_path / "home" / "server.json"
    try:
        cli(env, "server", "start", timeout=60)
        recorded = json.loads(state.read_text())
        assert recorded["checkout"] == CHECKOUT  # beside the server's URL: who started it
        own = cli(env, "server", "url")
        assert "started from" not in own.stderr, own.stderr  # this checkout's own server: nothing to say
        # As another clone's `make run` leaves it: the same per-user home, the same server.
        write_private(state, json.dumps({**recorded, "checkout": "/elsewhere/renderfleet"}))
        other = cli(env, "server", "url")
        assert other.stdout == own.stdout  # the same server, standard output untouched
        said = [line for line in other.stderr.splitlines() if "/elsewhere/renderfleet" in line]
        assert len(said) == 1 and CHECKOUT in said[0] and "RENDERFLEET_HOME" in said[0], other.stderr
        job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 2)), *TINY).stdout.split()[-1]
        for command in (("status",), ("resume", job[:8])):  # each finds the server more than once
            out = cli(env, *command)
            assert out.stderr.count("/elsewhere/renderfleet") == 1, out.stderr
    finally:
        cli(env, "server", "stop")


def test_a_state_file_naming_someone_elses_server_is_never_adopted_nor_stopped(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    foreign = start_redis(tmp_path / "foreign")  # a real redis-server, alive, not ours
    try:
        pid = foreign.proc.pid if foreign.proc else 0
        for url in (foreign.url, foreign.url.replace("redis://", "redis://:guessed@")):
            (home / "server.json").write_text(json.dumps({"url": url, "pid": pid}))
            assert trusted_server(home) is None
            with pytest.raises(ConfigError, match="did not start"):
                stop_embedded(home)
            assert ping(foreign.url) and (home / "server.json").exists()
        (home / "server.json").write_text(json.dumps({"url": foreign.url, "pid": pid}))
        mine = ensure_embedded(home)
        try:
            assert mine != foreign.url and ping(mine) and ping(foreign.url)
        finally:
            assert stop_embedded(home)
        assert ping(foreign.url)
    finally:
        foreign.stop()


def test_a_state_file_naming_a_password_protected_server_we_did_not_start_is_never_adopted(tmp_path: Path) -> None:
    # Everything a state file can say is true here (loopback, the real password, the
    # real pid of a redis-server that refuses clients without it); only where the
    # server was started from tells it apart from ours.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    foreign = RedisServerProcess(workdir=tmp_path / "elsewhere" / "redis", password="their-Pa55word")
    foreign.start()
    try:
        pid = foreign.proc.pid if foreign.proc else 0
        (home / "server.json").write_text(json.dumps({"url": foreign.url, "pid": pid}))
        assert trusted_server(home) is None
        with pytest.raises(ConfigError) as err:
            stop_embedded(home)
        assert f"pid {pid}" in str(err.value) and "their-Pa55word" not in str(err.value)
        assert ping(foreign.url) and (home / "server.json").exists()
        # The same server named from a home whose redis/server.conf it was not started from:
        (home / "redis").mkdir(mode=0o700)
        (home / "redis" / "server.conf").write_text("requirepass their-Pa55word\n")
        (home / "redis" / "server.conf").chmod(0o600)
        assert trusted_server(home) is None
    finally:
        foreign.stop()
    # A state file whose server is gone is stale: removed, nothing to stop.
    assert stop_embedded(home) is False and not (home / "server.json").exists()


def test_a_stopped_servers_port_is_held_until_its_restart_so_no_other_server_takes_it(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "ours")
    client = redis.Redis.from_url(server.url, socket_connect_timeout=2)
    try:
        client.set("mine", "1")
        server.kill()
        # Held: no one else's bind gets the port (free_port's bind(0) skips it), yet no one is served on it.
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", server.port))
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()  # same port, empty: the hold let go for it
        assert client.ping() and client.get("mine") is None
    finally:
        server.close()


def test_a_server_that_cannot_have_its_port_does_not_take_anothers_for_its_own(tmp_path: Path) -> None:
    theirs = start_redis(tmp_path / "theirs")
    try:
        redis.Redis.from_url(theirs.url).set("theirs", "1")
        # Another server's port: ours cannot bind it and exits, while theirs answers every PING there.
        ours = RedisServerProcess(theirs.port, workdir=tmp_path / "ours")
        with pytest.raises(ConfigError, match=f"did not start on port {theirs.port}"):
            ours.start()
        assert redis.Redis.from_url(theirs.url).get("theirs") == b"1"
    finally:
        theirs.close()
