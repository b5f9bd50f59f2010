"""The monitor's web page in a real headless Chromium (Debian's package, driven by Playwright).

A job is submitted before any worker runs, the page is opened, then a worker
starts: the page's figures must move on their own (live updates, no reload)
to the end.  Then the job's page: its quarantined prompt with its error, the
gallery's thumbnails (made once, kept in the store), a caption on hover and
click, the next page and back.  Off loopback, the token: refused without it,
``?token=`` once sets an HttpOnly cookie, and every request needs one or the
other.

Set ``RENDERFLEET_WEB_SCREENSHOTS=DIR`` to keep the screenshots (docs/monitor.png).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dispatcher.status.status import FleetStatus
from dispatcher.views.web import charts, read_history, record
from renderfleet import keys
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from testing.fleet import REPO, TINY, WorkerProc, base_env, cli, pause_at, stopped, wait_for
from testing.servers import free_port
from testing.servers import http_get as get

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
PROMPTS = 72  # more than one gallery page (60)


@pytest.fixture
def browser() -> Iterator[object]:
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():  # `make test` installs Debian's chromium; say so rather than fail obscurely
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install chromium` (the Makefile's install step does)")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


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


def watch_csp(page: object) -> list[str]:
    """What the page's Content-Security-Policy refused (Chromium reports each on the console), and script errors."""
    refused: list[str] = []
    page.on("console", lambda m: refused.append(f"{page.url}: {m.text}") if "Content Security Policy" in m.text else None)  # type: ignore[attr-defined]
    page.on("pageerror", lambda e: refused.append(str(e)))  # type: ignore[attr-defined]
    return refused


def keep(page: object, name: str, tmp: Path) -> None:
    path = tmp / name
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    if out := os.environ.get("RENDERFLEET_WEB_SCREENSHOTS"):
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / name)


def test_the_page_shows_a_running_job_move_and_pages_its_gallery(
    tmp_path: Path, redis_server: RedisServerProcess, browser: object
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[pools.default]\nkind = "spot"\nprice_per_hour = 1.2\nmin = 0\nmax = 2\n')
    store = tmp_path / "store"
    # Leases long enough that the worker's pause below (seconds) hands nothing back.
    env = base_env(tmp_path, redis_server.url, str(store), RENDERFLEET_CONFIG=str(config), RENDERFLEET_LEASE_SECONDS="30")
    lines = [
        json.dumps({"prompt": f"a lighthouse at dusk, study {i}", **({"id": "bad"} if i == 17 else {})})
        for i in range(PROMPTS)
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    job = cli(env, "submit", str(tmp_path / "p.jsonl"), *TINY, "--shard-size", "4", "--batch-size", "2").stdout.split()[-1]
    # The store refuses this one image (a folder where its file goes): quarantined after 3 tries, with its error.
    (store / "jobs" / job / "images" / "bad.png").mkdir(parents=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    monitor = start_monitor(env, f"127.0.0.1:{port}", tmp_path / "monitor.log")
    worker: WorkerProc | None = None
    try:
        wait_for(lambda: get(f"{base}/api/status")[0] == 200, 30, what="the endpoint")
        page = browser.new_page(viewport={"width": 1280, "height": 1400})  # type: ignore[attr-defined]
        refused = watch_csp(page)
        response = page.goto(f"{base}/")
        assert "script-src 'self'" in response.headers["content-security-policy"]
        row = page.locator(f'tr[data-job="{job}"]')
        assert row.locator(".f-done").inner_text() == "0"

        # A worker starts; the open page (never reloaded) follows the job to its end.  The worker
        # stops itself (SIGSTOP) before it writes its second batch, its first one counted and
        # nothing in flight, so however fast the machine, the page must show a value part-way
        # (that one), then the end.
        client = redis.Redis.from_url(redis_server.url)
        worker = WorkerProc({**env, **pause_at("after-render#2")}, tmp_path / "worker.log")
        wait_for(lambda: stopped(worker.pid), 120, interval=0.05, what="the worker to stop after its first batch")
        try:
            paused = int(client.bitcount(keys.done_bits(job)))
            assert paused == 2  # the first batch (prompts 0 and 1), and no more
            page.wait_for_function(
                f"() => document.querySelector('tr[data-job=\"{job}\"] .f-done').textContent === '{paused}'", timeout=15_000
            )
            assert row.locator(".fill").evaluate("el => parseFloat(el.style.width)") < 100
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        page.wait_for_function(
            f"() => {{ const r = document.querySelector('tr[data-job=\"{job}\"]'); "
            "return +r.querySelector('.f-done').textContent"
            " + +r.querySelector('.f-quarantined').textContent"
            f" === {PROMPTS}; }}",
            timeout=240_000,
        )
        assert row.locator(".f-done").inner_text() == str(PROMPTS - 1)
        assert row.locator(".f-quarantined").inner_text() == "1"
        assert row.locator(".f-eta").inner_text() == "done"
        assert row.locator(".f-cost").inner_text().startswith("$")
        # rendered in green, the quarantined prompt in red: together the whole bar
        widths = [row.locator(part).evaluate("el => parseFloat(el.style.width)") for part in (".fill", ".fill-q")]
        assert widths[1] > 0 and sum(widths) == pytest.approx(100, abs=0.2)
        # the worker's row and the charts (drawn on the server from the samples in Redis)
        assert page.locator("#workers tr").count() == 1
        page.reload()
        assert page.locator("svg.chart").count() >= 4  # queue, backlog x2, the pool's size
        assert page.locator("svg.chart polyline").count() >= 1
        keep(page, "monitor.png", tmp_path)

        # The job's page: the quarantined prompt with its error, then the gallery.
        page.locator(f'a[href="/jobs/{job}"]').first.click()
        page.wait_for_url(f"{base}/jobs/{job}")
        # the bar drawn from the page itself (no inline style: the script sets it), before any poll
        drawn = [
            page.locator(f'tr[data-job="{job}"] {part}').evaluate("el => parseFloat(el.style.width)")
            for part in (".fill", ".fill-q")
        ]
        assert drawn[1] > 0 and sum(drawn) == pytest.approx(100, abs=0.2)
        quarantine = page.locator("table.quarantine")
        assert "bad" in quarantine.inner_text() and "study 17" in quarantine.inner_text()
        assert quarantine.locator("td.error").inner_text().strip()
        thumbs = page.locator("figure.thumb")
        assert thumbs.count() == 60
        names = [thumbs.nth(i).get_attribute("data-name") for i in range(60)]
        assert names == sorted(names) and names[0] == "000000"
        page.locator("#gallery").scroll_into_view_if_needed()
        page.wait_for_function(
            "() => [...document.querySelectorAll('figure.thumb img')].every(i => i.complete && i.naturalWidth > 0)",
            timeout=60_000,
        )
        # prompt, seed and size on hover (the title) and on click (the detail panel)
        first = thumbs.nth(0)
        first.hover()
        page.wait_for_function("() => document.querySelector('figure.thumb img').title.includes('seed')")
        title = first.locator("img").get_attribute("title") or ""
        assert "study 0" in title and "32x32" in title
        first.locator("a").click()
        page.wait_for_selector("#detail:not([hidden]) pre")
        assert "study 0" in page.locator("#detail pre").inner_text()
        keep(page, "monitor-job.png", tmp_path)

        # The next page: the remaining 11 (72 prompts, one quarantined), then back.
        page.locator("#next").click()
        page.wait_for_url(f"{base}/jobs/{job}?page=2#gallery")
        assert page.locator("figure.thumb").count() == PROMPTS - 1 - 60
        assert page.locator("#next").count() == 0
        page.wait_for_function(
            "() => [...document.querySelectorAll('figure.thumb img')].every(i => i.complete && i.naturalWidth > 0)",
            timeout=60_000,
        )
        page.locator("#prev").click()
        page.wait_for_url(f"{base}/jobs/{job}?page=1#gallery")
        assert page.locator("figure.thumb").count() == 60
        # the full image opened on its own, then: the policy refused nothing the page does
        page.goto(f"{base}/jobs/{job}/images/000000")
        assert refused == []

        # Thumbnails were made once and kept in the store, under the job's prefix.
        thumbs_dir = store / "jobs" / job / "thumbs"
        assert len(list(thumbs_dir.glob("*.webp"))) == PROMPTS - 1
        stamp = (thumbs_dir / "000000.webp").stat().st_mtime_ns
        assert get(f"{base}/jobs/{job}/thumbs/000000")[0] == 200
        assert (thumbs_dir / "000000.webp").stat().st_mtime_ns == stamp

        # The same data as JSON, and no URL reaches outside a job's prefix.
        status, body = get(f"{base}/api/jobs/{job}?page=2")
        data = json.loads(body)
        assert status == 200 and data["job"]["done"] == PROMPTS - 1 and len(data["images"]) == 11
        for path in (
            f"/jobs/{job}/thumbs/..%2F..%2F{job}%2Fspec",
            f"/jobs/{job}/images/spec",
            f"/jobs/{job}/images/.hidden",
            f"/jobs/{job}/thumbs/bad",
            "/jobs/..%2Fjobs",
            "/jobs/.x",
            "/jobs/no-such-job",
            f"/api/jobs/{job}/images/nope",
            "/jobs/a%20b/images/000000",
        ):
            assert get(base + path)[0] == 404, path
    finally:
        if worker:
            worker.kill()
        stop(monitor)


def test_a_job_with_stages_shows_each_stage_on_its_page_and_the_figures_move(
    tmp_path: Path, redis_server: RedisServerProcess, browser: object
) -> None:
    # No worker: the stage figures a worker's ledger writes (keys.job_stages) are written here.
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    (tmp_path / "p.txt").write_text("a heron\na fox\n")
    stages = ["--upscale", "2", "--refine", "self:0.5:2"]
    job = cli(env, "submit", str(tmp_path / "p.txt"), *TINY, *stages).stdout.split()[-1]
    client = redis.Redis.from_url(redis_server.url)
    client.hset(
        keys.job_stages(job), mapping={"images.generate": 2, "ms.generate": 800, "images.upscale-1": 2, "ms.upscale-1": 20}
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    monitor = start_monitor(env, f"127.0.0.1:{port}", tmp_path / "monitor.log")
    try:
        wait_for(lambda: get(f"{base}/api/status")[0] == 200, 30, what="the endpoint")
        page = browser.new_page()  # type: ignore[attr-defined]
        refused = watch_csp(page)
        page.goto(f"{base}/jobs/{job}")
        rows = page.locator("#stages tr[data-stage]")
        assert [rows.nth(i).get_attribute("data-stage") for i in range(rows.count())] == [
            "generate",
            "upscale-1",
            "refine-2",
        ]
        assert "refine with the job's model at strength 0.5" in rows.nth(2).inner_text()
        assert rows.nth(0).get_attribute("class") == "bound" and page.locator("#stages .f-bound").inner_text() == "generate"
        assert rows.nth(2).locator(".f-spi").inner_text() == "-"  # nothing refined yet
        # The refine made its images, slower than generate: the open page follows (live, no reload).
        client.hset(keys.job_stages(job), mapping={"images.refine-2": 2, "ms.refine-2": 3000})
        page.wait_for_function("() => document.querySelector('#stages .f-bound').textContent === 'refine-2'", timeout=15_000)
        assert rows.nth(2).locator(".f-spi").inner_text() == "1.5" and rows.nth(2).get_attribute("class") == "bound"
        assert rows.nth(2).locator(".f-share").inner_text() == "79%"
        assert refused == []
    finally:
        stop(monitor)


def test_off_loopback_the_page_needs_the_token_and_a_browser_gets_an_httponly_cookie(
    tmp_path: Path, redis_server: RedisServerProcess, browser: object
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    port = free_port()
    refused = subprocess.run(
        [sys.executable, "-m", "renderfleet", "monitor", "--once", "--http", f"0.0.0.0:{port}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert refused.returncode == 2 and "RENDERFLEET_HTTP_TOKEN" in refused.stderr
    token = "s3cret-web-token"
    monitor = start_monitor({**env, "RENDERFLEET_HTTP_TOKEN": token}, f"0.0.0.0:{port}", tmp_path / "m.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get(f"{base}/metrics")[0] in (200, 401), 30, what="the endpoint")
        context = browser.new_context()  # type: ignore[attr-defined]
        page = context.new_page()
        for path in ("/", "/?token=wrong", "/api/status", "/metrics", "/static/live.js", "/jobs/x"):
            assert page.goto(base + path).status == 401, path
        # ?token= once: a cookie (HttpOnly, not readable by scripts), and the token gone from the address
        response = page.goto(f"{base}/?token={token}")
        assert response.status == 200 and page.url == f"{base}/"
        assert "Workers" in page.content()
        cookies = context.cookies()
        assert [c["httpOnly"] for c in cookies] == [True] and cookies[0]["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""
        # with the cookie, every request passes, the page's own polling included
        assert page.goto(f"{base}/api/status").status == 200
        page.goto(f"{base}/")
        # The page polls every 2 s: its first poll is let in, and by the time it sends the next one
        # (scheduled once the answer is handled) it has said nothing about not updating.
        with page.expect_response(lambda r: "/api/page" in r.url, timeout=30_000) as first_poll:
            pass
        assert first_poll.value.status == 200
        with page.expect_request(lambda r: "/api/page" in r.url, timeout=30_000):
            pass
        assert page.locator("#live-state").inner_text() == ""
        # a fresh browser without it is refused again; scripts use the header
        other = browser.new_context().new_page()  # type: ignore[attr-defined]
        assert other.goto(f"{base}/api/status").status == 401
        assert get(f"{base}/api/status", token=token)[0] == 200
        assert get(f"{base}/api/status", token="wrong")[0] == 401
        assert get(f"{base}/jobs/x", token=token)[0] == 404
    finally:
        stop(monitor)


def test_the_charts_history_lives_in_redis_capped(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = "s3://bucket/renders"
    queue = queue_name("default", store)
    fleet = FleetStatus(queues={queue: 4}, workers=[{"pool": "default"}], desired={"default": 2}, store=store)
    # Another store's monitor on the same Redis, with a pool of the same name: its own charts.
    other = FleetStatus(queues={queue_name("default", "/other"): 50}, workers=[], desired={"spot": 7}, store="/other")
    now = time.time()
    for i in range(keys.HISTORY_KEEP + 10):
        fleet.queues[queue] = i
        record(client, fleet, now=now - (keys.HISTORY_KEEP + 10 - i))
        record(client, other, now=now - (keys.HISTORY_KEEP + 10 - i))
    hist = read_history(client, ["queue_shards", "workers.default", "desired.default"], store, now=now)
    assert len(hist["queue_shards"]) == keys.HISTORY_KEEP  # capped, the oldest dropped
    assert hist["queue_shards"][-1][1] == keys.HISTORY_KEEP + 9 and hist["desired.default"][0][1] == 2
    drawn = [str(c) for c in charts(client, store, now=now)]
    assert len(drawn) == 4 and all("<polyline" in c for c in drawn)  # queue, backlog x2, the pool: not spot
    assert {v for _, v in read_history(client, ["queue_shards"], "/other", now=now)["queue_shards"]} == {50}
    # samples older than the hour are not drawn
    assert read_history(client, ["queue_shards"], store, now=now + 2 * 3600) == {"queue_shards": []}
