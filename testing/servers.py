"""Real servers for integration tests, each run as a subprocess on 127.0.0.1."""

from __future__ import annotations

# ---- S3 (moto server mode) ----
import http.client
import http.server
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """moto's S3 (and friends) in server mode, spoken to over real HTTP.

    ``with MotoServer() as moto: moto.endpoint_url`` starts it on a free port,
    waits until it answers and kills it on exit.  Its output goes to a log
    file whose tail is shown if it fails to start.
    """

    def __init__(self, *, port: int | None = None, start_timeout: float = 30.0):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._logdir = tempfile.TemporaryDirectory(prefix="rf-moto-")
        self.log_path = Path(self._logdir.name) / "moto.log"

    def start(self) -> MotoServer:
        """Start the server and wait until it answers HTTP."""
        # ``python -m moto.server`` from this interpreter: the venv's moto, wherever the venv is.
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"moto server exited with status {self.proc.returncode}")
            if self._answers():
                return self
            time.sleep(0.05)
        self.stop()
        self._fail(f"moto server did not answer on {self.endpoint_url} within {self.start_timeout} s")
        raise AssertionError("unreachable")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means it is up
        except OSError:
            return False

    def _fail(self, why: str) -> None:
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"{why}; log tail:\n{tail}")

    def stop(self) -> None:
        """Kill the server (terminate, then kill if it lingers)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
        self._logdir.cleanup()


def s3_env(endpoint: str, bucket: str) -> dict[str, str]:
    """Environment for a process that talks to ``endpoint`` as S3 with moto's test keys.

    botocore reads ``AWS_ENDPOINT_URL`` itself, so a store opened in that
    process needs nothing more.  ``bucket`` sets no variable (the store URL,
    ``s3://{bucket}/...``, is the caller's to pass); it is in the signature so
    call sites read as "this endpoint, this bucket".
    """
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


class FlakyS3Proxy:
    """An HTTP proxy to moto that answers the first ``fail_first`` requests with an S3 error.

    ``fail_first=-1`` fails every request.  ``hits`` counts requests seen.
    """

    def __init__(self, upstream: str, *, fail_first: int, status: int = 503, code: str = "SlowDown"):
        self.upstream = upstream.removeprefix("http://")
        self.fail_first, self.status, self.code = fail_first, status, code
        self.hits = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.hits += 1
                    fail = proxy.fail_first < 0 or proxy.hits <= proxy.fail_first
                if fail:
                    self._error()
                else:
                    self._forward(body)

            def _error(self) -> None:
                xml = (
                    f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{proxy.code}</Code>"
                    "<Message>injected by the test</Message><RequestId>t</RequestId></Error>"
                ).encode()
                self.send_response(proxy.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)

            def _forward(self, body: bytes) -> None:
                skip = {"connection", "expect", "transfer-encoding", "content-length", "date", "server"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for name, value in resp.getheaders():
                    if name.lower() not in skip:
                        self.send_header(name, value)
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815 - http.server names them

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyS3Proxy:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- Redis with TLS and a password ----


def make_certs(d: Path) -> None:
    """With the ``openssl`` command, in ``d``: a CA of our own (``ca.crt``) and a server
    certificate for 127.0.0.1 signed by it (``server.crt``, ``server.key``)."""
    run = lambda *args: subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)  # noqa: E731
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=renderfleet test CA",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    )


class TlsRedis:
    """A real ``redis-server`` serving only TLS, with ``requirepass``, on a free port.

    Certificates are made for the test with the ``openssl`` command: a CA of
    our own and a server certificate for 127.0.0.1 signed by it.  ``url`` trusts
    that CA; ``untrusted_url`` relies on the system's CAs, which do not.
    """

    def __init__(self, workdir: Path, password: str):
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ca = workdir / "ca.crt"

    def start(self) -> TlsRedis:
        import redis

        self.workdir.mkdir(parents=True, exist_ok=True)
        make_certs(self.workdir)
        conf = self.workdir / "redis.conf"
        conf.write_text(f"requirepass {self.password}\n")
        d = self.workdir
        self.proc = subprocess.Popen(
            [
                "redis-server",
                str(conf),
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(d / "server.crt"),
                "--tls-key-file",
                str(d / "server.key"),
                "--tls-ca-cert-file",
                str(self.ca),
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(d),
                "--logfile",
                str(d / "server.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=0.5).ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"TLS redis did not start: {(d / 'server.log').read_text(errors='replace')[-1000:]}")

    def url_with(self, password: str, *, trusted: bool = True) -> str:
        query = f"?ssl_ca_certs={self.ca}&ssl_cert_reqs=required" if trusted else "?ssl_cert_reqs=required"
        return f"rediss://:{password}@127.0.0.1:{self.port}/0{query}"

    @property
    def url(self) -> str:
        return self.url_with(self.password)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


# ---- Redis with Sentinel: a primary, a replica, three sentinels ----


class SentinelRedis:
    """A Sentinel-managed Redis of real processes on free loopback ports: a primary, one replica
    (``--replicaof``) and three sentinels (``redis-server sentinel.conf --sentinel``, quorum 2),
    every Redis node with ``requirepass`` (and ``masterauth``, so either can follow the other).

    Fast to fail over: a node is down after ``down_after_ms`` without an answer, a failover
    may take ``failover_timeout_ms``.  ``url`` is renderfleet's ``redis+sentinel://`` URL.
    ``tls``: every process speaks TLS only (replication and the sentinels' links too), with a
    certificate from a CA of the test's own (:func:`make_certs`); ``url`` is then
    ``rediss+sentinel://`` trusting that CA.
    """

    MASTER = "mymaster"

    def __init__(
        self, workdir: Path, password: str, *, down_after_ms: int = 1000, failover_timeout_ms: int = 3000, tls: bool = False
    ):
        self.workdir = workdir
        self.password = password
        self.tls = tls
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.ports = {"primary": free_port(), "replica": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        if self.tls:
            return f"rediss+sentinel://:{self.password}@{hosts}/{self.MASTER}/0?ssl_ca_certs={self.workdir / 'ca.crt'}"
        return f"redis+sentinel://:{self.password}@{hosts}/{self.MASTER}/0"

    def connect(self, port: int, *, password: bool = True) -> Any:
        """A plain redis-py client of one process (a node, with its password; a sentinel, without)."""
        import redis

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.workdir / "ca.crt")} if self.tls else {}
        return redis.Redis(port=port, password=self.password if password else None, socket_timeout=2, **tls)

    def _listen(self, port: int) -> str:
        """The config lines that make a process listen on ``port`` (TLS only, when ``tls``)."""
        if not self.tls:
            return f"port {port}\n"
        w = self.workdir
        return (
            f"port 0\ntls-port {port}\ntls-cert-file {w / 'server.crt'}\ntls-key-file {w / 'server.key'}\n"
            f"tls-ca-cert-file {w / 'ca.crt'}\ntls-auth-clients no\ntls-replication yes\n"
        )

    def _spawn(self, name: str, conf: str, *args: str) -> None:
        d = self.workdir / name
        d.mkdir(parents=True, exist_ok=True)
        path = d / "redis.conf"
        path.write_text(conf + f"dir {d}\nlogfile {d / 'server.log'}\nbind 127.0.0.1\n")
        from renderfleet.embedded import server_binary  # redis-server, else valkey-server: both have --sentinel

        self.procs[name] = subprocess.Popen(
            [server_binary(), str(path), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self, timeout: float = 30.0) -> SentinelRedis:
        """Start every process; return once the replica is in sync and each sentinel sees
        the replica and both other sentinels."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            make_certs(self.workdir)
        auth = f"requirepass {self.password}\nmasterauth {self.password}\n"
        # repl-diskless-sync-delay 0: the replica's first sync now, not in Redis 7's default 5 s.
        data = auth + 'save ""\nappendonly no\nrepl-diskless-sync-delay 0\n'
        self._spawn("primary", data + self._listen(self.ports["primary"]))
        self._spawn("replica", data + self._listen(self.ports["replica"]) + f"replicaof 127.0.0.1 {self.ports['primary']}\n")
        self._wait(self._replica_in_sync, timeout, "the replica to sync")
        # Started once the replica is in sync: a sentinel finds it at its first look at the primary.
        for i, port in enumerate(self.sentinel_ports):
            self._spawn(
                f"sentinel-{i}",
                (
                    self._listen(port) + f"sentinel monitor {self.MASTER} 127.0.0.1 {self.ports['primary']} 2\n"
                    f"sentinel auth-pass {self.MASTER} {self.password}\n"
                    f"sentinel down-after-milliseconds {self.MASTER} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {self.MASTER} {self.failover_timeout_ms}\n"
                ),
                "--sentinel",
            )
        self._wait(self._sentinels_settled, timeout, "the sentinels to see the replica and each other")
        return self

    def _wait(self, settled: Callable[[], bool], timeout: float, what: str) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if settled():
                    return
            except redis.RedisError:
                pass
            if any(proc.poll() is not None for proc in self.procs.values()):
                break
            time.sleep(0.05)
        logs = {name: self.log(name)[-600:] for name in self.procs}
        self.stop()
        raise RuntimeError(f"Sentinel-managed Redis: gave up waiting for {what}; logs: {logs}")

    def _replica_in_sync(self) -> bool:
        replica = self.connect(self.ports["replica"])
        return bool(replica.info("replication").get("master_link_status") == "up")

    def _sentinels_settled(self) -> bool:
        for port in self.sentinel_ports:
            state: Any = self.connect(port, password=False).sentinel_master(self.MASTER)
            if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2:
                return False
        return True

    def primary_port(self) -> int | None:
        """The primary's port as the first sentinel that answers names it."""
        import redis

        for port in self.sentinel_ports:
            try:
                answer: Any = self.connect(port, password=False).sentinel_get_master_addr_by_name(self.MASTER)
                return int(answer[1])
            except (redis.RedisError, TypeError):
                continue
        return None

    def kill(self, name: str) -> None:
        """SIGKILL one process (``primary``, ``replica``, ``sentinel-N``), as a crash would."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def log(self, name: str) -> str:
        path = self.workdir / name / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def __enter__(self) -> SentinelRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def http_get(url: str, token: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, with ``Authorization: Bearer TOKEN`` when given; (0, b"") when nothing listens."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:
        return 0, b""
