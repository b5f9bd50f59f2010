"""The monitor's web server under hostile or heavy use: the real ``renderfleet monitor --http`` in a subprocess.

- A burst of first views of the largest images a job may ask for, and one far
  larger, keeps the server's peak memory (``VmHWM``) under 500 MB.
- A malformed value in any Redis key the page reads is skipped with one
  warning; every page, ``/metrics`` and ``renderfleet status`` still answer.
- Without a token only a loopback ``Host`` is answered (DNS rebinding);
  a hostile query is a 400, never a 500; every answer carries the security
  headers; a weak token is refused at start-up, naming the setting.
"""

from __future__ import annotations

import http.client
import json
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet import spec as layout
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_identity, store_tag
from testing.fleet import REPO, base_env, cli, wait_for
from testing.servers import free_port
from testing.servers import http_get as get

pytestmark = pytest.mark.integration

PEAK_LIMIT = 500 * 2**20  # bytes: the monitor's resident peak during the burst
VIEWS = 45  # concurrent first views


def start_monitor(env: dict[str, str], address: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "monitor", "--http", address],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def request(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """One GET with exactly these headers (http.client sends Host itself unless given); redirects not followed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.putrequest("GET", path, skip_host="Host" in (headers or {}))
    for name, value in (headers or {}).items():
        conn.putheader(name, value)
    conn.endheaders()
    resp = conn.getresponse()
    resp.body = resp.read()  # type: ignore[attr-defined]
    conn.close()
    return resp


def solid_png(width: int, height: int, prompt: str) -> bytes:
    """A PNG of one colour, written row by row: a 9000x9000 image costs a few hundred kB and no 243 MB buffer."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    deflate = zlib.compressobj(9)
    row = b"\x00" + bytes((40, 90, 160)) * width  # filter byte 0, then RGB
    body = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"tEXt", b"prompt\x00" + prompt.encode())
        + chunk(b"IDAT", body)
        + chunk(b"IEND", b"")
    )


def peak_rss(pid: int) -> int:
    """The process's resident peak (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def submit(env: dict[str, str], tmp: Path, n: int, size: str = "32x32") -> str:
    (tmp / "p.txt").write_text("".join(f"a lighthouse, study {i}\n" for i in range(n)))
    return cli(
        env, "submit", str(tmp / "p.txt"), "--model", "tiny", "--steps", "2", "--size", size, "--shard-size", "4"
    ).stdout.split()[-1]


def test_a_burst_of_first_views_of_large_images_keeps_the_monitor_under_500_mb(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store))
    job = submit(env, tmp_path, 11, "4096x4096")
    # Ten images of the largest size a job may ask for (48 MiB each decoded), and one of 9000x9000
    # (232 MiB decoded: over the cap, so its header alone is read).
    images = store / "jobs" / job / "images"
    images.mkdir(parents=True, exist_ok=True)
    big = solid_png(4096, 4096, "large")
    names = [layout.index_name(i) for i in range(11)]
    for name in names[:10]:
        (images / f"{name}.png").write_bytes(big)
    (images / f"{names[10]}.png").write_bytes(solid_png(9000, 9000, "huge"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    monitor = start_monitor(env, f"127.0.0.1:{port}", tmp_path / "monitor.log")
    try:
        wait_for(lambda: get(f"{base}/api/status")[0] == 200, 60, what="the endpoint")
        before = peak_rss(monitor.pid)
        results: list[tuple[str, int, bytes]] = []
        start = threading.Barrier(VIEWS)

        def view(name: str) -> None:
            start.wait()
            resp = request(port, f"/jobs/{job}/thumbs/{name}")
            results.append((name, resp.status, resp.body))  # type: ignore[attr-defined]

        threads = [threading.Thread(target=view, args=(names[i % len(names)],)) for i in range(VIEWS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        peak = peak_rss(monitor.pid)
        assert len(results) == VIEWS and all(status == 200 and body[8:12] == b"WEBP" for _, status, body in results)
        assert peak < PEAK_LIMIT, f"peak {peak / 2**20:.0f} MiB (from {before / 2**20:.0f} MiB at start)"
        assert len(list((store / "jobs" / job / "thumbs").glob("*.webp"))) == len(names)
        # the image over the cap has a placeholder, and its caption says why
        status, body = get(f"{base}/api/jobs/{job}/images/{names[10]}")
        meta = json.loads(body)
        assert status == 200 and meta["size"] == "9000x9000" and "megapixels" in meta["preview"]
        assert json.loads(get(f"{base}/api/jobs/{job}/images/{names[0]}")[1])["prompt"] == "large"
    finally:
        stop(monitor)


def test_a_malformed_redis_value_is_skipped_once_and_every_page_and_status_still_answer(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    job = submit(env, tmp_path, 8)
    client = redis.Redis.from_url(redis_server.url)
    store = str(tmp_path / "store")
    tag = store_tag(store)
    client.hset(
        keys.WORKERS,
        mapping={
            "w-good": json.dumps({"worker": "w-good", "pool": "default", "model": "tiny", "store": store_identity(store)}),
            "w-text": "not json",
            "w-list": "[1, 2]",
            "w-nan": '{"pool": NaN}',
            "w-huge": '{"pool": 1e999}',
            "w-deep": "[" * 100_000 + "]" * 100_000,
            "w-bytes": b"\xff\xfe",
        },
    )
    client.hset(keys.worker_stats("w-good"), mapping={"since": "soon", "images": "many"})
    client.hset(
        keys.pool_stats("default", tag),
        mapping={"images": "many", "render_ms": "1e3", "batches": "12", "mps_milli": str(2**70)},
    )
    client.hset(keys.desired(tag), mapping={"default": "two", "spot": "1"})
    client.hset(keys.FLEET_STATS, "reaped", "x")
    client.lpush(keys.history("queue_shards", tag), "nan nan", "1 inf", "garbage", b"\xff 1")
    client.hset(keys.job(job), mapping={"spec": "{not json", "total": "lots"})
    client.hset(keys.job_stats(job), mapping={"render_ms.default": "x", "wasted_images": "1.5"})
    client.lpush(keys.progress(job), "abc", "1 0", "nan 3", f"1 {'9' * 30}")
    client.hset(keys.attempts(job), "0", "x")
    client.hset(keys.left(job), "0", "x")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "monitor.log"
    monitor = start_monitor(env, f"127.0.0.1:{port}", log)
    try:
        wait_for(lambda: get(f"{base}/api/status")[0] != 0, 60, what="the endpoint")
        for _ in range(3):  # the page polls: each skipped value is logged once, not at every read
            for path in ("/", "/api/status", "/metrics", "/api/autoscale", f"/jobs/{job}", f"/api/jobs/{job}"):
                status, body = get(base + path)
                assert status == 200, (path, body[:500])
        data = json.loads(get(f"{base}/api/status")[1])
        assert [w["worker"] for w in data["workers"]] == ["w-good"]
        assert data["pools"]["default"] == {"batches": 12} and data["desired"] == {"spot": 1}
        assert data["leases_reaped"] == 0 and [j["job"] for j in data["jobs"]] == [job]
        for args in (["status"], ["status", "--json"], ["status", job]):
            done = cli(env, *args)
            assert "Traceback" not in done.stderr, done.stderr
        text = log.read_text()
        assert "Traceback" not in text
        assert text.count("skipping a malformed value in Redis at rf:workers b'w-text'") == 1
        assert text.count(f"at {keys.pool_stats('default', tag)} images: not a 64-bit integer") == 1
        assert f"at {keys.job(job)} spec" in text and f"at {keys.progress(job)}" in text
    finally:
        stop(monitor)


def test_the_tokenless_monitor_answers_only_loopback_hosts_and_hostile_queries_with_400(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_HTTP_HOSTS="monitor.lan")
    job = submit(env, tmp_path, 4)
    port = free_port()
    monitor = start_monitor(env, f"127.0.0.1:{port}", tmp_path / "monitor.log")
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port}/api/status")[0] == 200, 60, what="the endpoint")
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", "monitor.lan", "monitor.lan:81"):
            assert request(port, "/api/status", {"Host": host}).status == 200, host
        # a page on another name that DNS-rebinds to 127.0.0.1 reads nothing; nor another port's name
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "localhost", "", "monitor.lan.x"):
            resp = request(port, "/api/status", {"Host": host})
            assert resp.status == 400 and b"RENDERFLEET_HTTP_HOSTS" in resp.body, host  # type: ignore[attr-defined]
        for page in ("9223372036854775807", "0", "-1", "abc", "1e3", "", "%EF%BC%91", "1%00"):
            assert request(port, f"/jobs/{job}?page={page}").status == 400, page
            assert request(port, f"/api/jobs/{job}?page={page}").status == 400, page
        assert request(port, f"/jobs/{job}?page=100000000").status == 200
        # every answer, a refusal included, carries the security headers
        for path, host in (
            ("/", f"127.0.0.1:{port}"),
            ("/static/live.js", f"127.0.0.1:{port}"),
            ("/api/status", "evil.example"),
            ("/nowhere", f"127.0.0.1:{port}"),
        ):
            resp = request(port, path, {"Host": host})
            assert "frame-ancestors 'none'" in (resp.getheader("Content-Security-Policy") or ""), path
            assert resp.getheader("X-Content-Type-Options") == "nosniff" and resp.getheader("X-Frame-Options") == "DENY"
            assert resp.getheader("Referrer-Policy") == "no-referrer"
    finally:
        stop(monitor)


@pytest.mark.parametrize("token", ["x", " " * 20, "short-token", "sixteen chars ok", "a\tb" * 8])
def test_a_weak_token_is_refused_at_start_up_naming_the_setting(
    tmp_path: Path, redis_server: RedisServerProcess, token: str
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_HTTP_TOKEN=token)
    done = cli(env, "monitor", "--once", "--http", f"0.0.0.0:{free_port()}", check=False, timeout=60)
    assert done.returncode == 2 and "RENDERFLEET_HTTP_TOKEN" in done.stderr and "16 characters" in done.stderr
    assert "Traceback" not in done.stderr
    if len(token.strip()) > 2:
        assert token not in done.stderr  # what is wrong with it, never the token itself


def test_behind_the_token_the_login_redirect_stays_on_the_site_and_the_cookie_is_secure_behind_tls(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    token = "a-token-of-32-characters-or-so-1"
    env = base_env(
        tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_HTTP_TOKEN=token, RENDERFLEET_HTTP_TLS_PROXY="1"
    )
    port = free_port()
    monitor = start_monitor(env, f"0.0.0.0:{port}", tmp_path / "monitor.log")
    try:
        wait_for(lambda: get(f"http://127.0.0.1:{port}/metrics")[0] == 401, 60, what="the endpoint")
        for path, where in (
            (f"//evil.example/?token={token}", "/evil.example/"),
            (f"/\\evil.example/?token={token}", "/evil.example/"),
            (f"///evil.example/?token={token}&page=2", "/evil.example/?page=2"),
        ):
            resp = request(port, path)
            assert resp.status == 303 and resp.getheader("Location") == where, path
        plain = request(port, f"/?token={token}").getheader("Set-Cookie") or ""
        behind = request(port, f"/?token={token}", {"X-Forwarded-Proto": "https"}).getheader("Set-Cookie") or ""
        assert "HttpOnly" in plain and "Secure" not in plain and "Secure" in behind
        # with a token the Host is not checked: a proxy's name reaches it; the token is what guards it
        assert (
            request(port, "/api/status", {"Host": "monitor.example.org", "Authorization": f"Bearer {token}"}).status == 200
        )
    finally:
        stop(monitor)
