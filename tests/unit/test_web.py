"""The web page's pieces without a server: charts, the gallery's pages, checked names, thumbnails."""

from __future__ import annotations

import io
import json
import struct
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from dispatcher.status.redisload import RedisLoad
from dispatcher.status.status import FleetStatus, JobStatus
from dispatcher.views.thumbs import THUMB_MAX_PIXELS, THUMBS_AT_ONCE, Thumbnails, make_thumbnail, placeholder, thumb_key
from dispatcher.views.web import (
    MAX_PAGE,
    PAGE_SIZE,
    BadQuery,
    NotHere,
    checked_image,
    checked_job,
    gallery_page,
    page_number,
    samples,
    svg_chart,
)
from renderfleet import spec as layout
from renderfleet.store import LocalStore


def png(seed: int) -> bytes:
    info = PngInfo()
    for key, value in {"prompt": f"a <b>fox</b> {seed}", "seed": str(seed), "steps": "2"}.items():
        info.add_text(key, value)
    buf = io.BytesIO()
    Image.new("RGB", (64, 32), (seed % 255, 10, 20)).save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    s = LocalStore(tmp_path / "store")
    s.put(layout.spec_key("j-1"), b"{}")
    for i in range(PAGE_SIZE + 5):
        s.put(layout.image_key("j-1", layout.index_name(i)), png(i))
    return s


def test_pages_list_only_names_in_the_stores_order(store: LocalStore) -> None:
    first, more = gallery_page(store, "j-1", 1)
    assert len(first) == PAGE_SIZE and more and first[0] == "000000"
    second, more = gallery_page(store, "j-1", 2)
    assert second == [layout.index_name(i) for i in range(PAGE_SIZE, PAGE_SIZE + 5)] and not more
    assert gallery_page(store, "j-1", 9) == ([], False)


@pytest.mark.parametrize("job", ["", "..", ".x", "a/b", "j-2", "j-1/../j-1", "x" * 101])
def test_a_job_from_a_url_must_be_a_job_the_store_holds(store: LocalStore, job: str) -> None:
    with pytest.raises(NotHere):
        checked_job(store, job)


@pytest.mark.parametrize("name", ["", "..", ".hidden", "../spec", "a/b", "a\\b", "999999", "spec"])
def test_an_image_name_from_a_url_must_be_an_image_the_job_has(store: LocalStore, name: str) -> None:
    assert checked_job(store, "j-1") == "j-1"
    with pytest.raises(NotHere):
        checked_image(store, "j-1", name)


def test_a_thumbnail_is_made_once_and_kept_under_the_jobs_prefix(store: LocalStore) -> None:
    name = checked_image(store, "j-1", "000003")
    thumbs = Thumbnails(store)
    thumb = thumbs.thumbnail("j-1", name)
    assert store.get(thumb_key("j-1", name)) == thumb and thumb_key("j-1", name).startswith("jobs/j-1/thumbs/")
    with Image.open(io.BytesIO(thumb)) as im:
        assert im.format == "WEBP" and max(im.size) <= 192
    meta = thumbs.meta("j-1", name)
    assert meta["prompt"] == "a <b>fox</b> 3" and meta["seed"] == "3" and meta["size"] == "64x32"
    assert "preview" not in meta
    store.put(thumb_key("j-1", name), b"kept")
    assert thumbs.thumbnail("j-1", name) == b"kept"  # never made again


def test_charts_are_inline_svg_with_text_escaped() -> None:
    svg = str(svg_chart("<script>x</script>", {"a": [(90.0, 1.0), (100.0, 3.0)], "b": []}, now=100.0))
    assert svg.startswith("<svg") and "<script>" not in svg and "&lt;script&gt;" in svg and "<polyline" in svg
    assert "no samples yet" in str(svg_chart("empty", {"a": []}, now=100.0))


def test_samples_are_bounded_one_per_pool() -> None:
    job = JobStatus("j", 10, 4, 1, 3, 2, 3, 1, 1, True)
    fleet = FleetStatus(
        queues={"q": 2}, workers=[{"pool": "spot"}, {"pool": "spot"}], jobs=[job], backlog_seconds=7.5, desired={"spot": 3}
    )
    assert samples(fleet) == {
        "queue_shards": 2.0,
        "backlog_images": 5.0,
        "backlog_seconds": 7.5,
        "workers.spot": 2.0,
        "desired.spot": 3.0,
    }
    json.dumps(samples(fleet))
    # Redis's main thread, as a percentage of a core, once a share is known (two readings apart)
    fleet.redis = RedisLoad(
        cpu_seconds=9.0, commands=1, clients=1, maxclients=10, used_memory=1, maxmemory=0, ops_per_second=1
    )
    assert "redis_cpu" not in samples(fleet)
    fleet.redis.cpu_share, fleet.redis.cpu_window = 0.4167, 5.0
    assert samples(fleet)["redis_cpu"] == 41.7


# ---- thumbnails: a pixel cap, a few at a time, once per image ----------------------------


class CountingStore(LocalStore):
    """A folder store that counts the image reads and how many run at once (each takes a little while)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.reads: Counter[str] = Counter()
        self.running = self.most = 0
        self.lock = threading.Lock()

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        if "/images/" not in key:
            return super().get(key, max_bytes=max_bytes)
        with self.lock:
            self.reads[key] += 1
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.05)
            return super().get(key, max_bytes=max_bytes)
        finally:
            with self.lock:
                self.running -= 1


def views(thumbs: Thumbnails, names: list[str]) -> list[bytes]:
    """One thread per name, all asking at once."""
    start = threading.Barrier(len(names))
    out: dict[int, bytes] = {}

    def view(i: int, name: str) -> None:
        start.wait()
        out[i] = thumbs.thumbnail("j-1", name)

    threads = [threading.Thread(target=view, args=(i, name)) for i, name in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [out[i] for i in range(len(names))]


def test_concurrent_first_views_of_one_image_wait_for_one_computation(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    store.put(layout.image_key("j-1", "000000"), png(0))
    made = views(Thumbnails(store), ["000000"] * 8)
    assert store.reads == {layout.image_key("j-1", "000000"): 1} and len(set(made)) == 1


def test_at_most_a_few_images_are_read_and_decoded_at_once(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    names = [layout.index_name(i) for i in range(12)]
    for i, name in enumerate(names):
        store.put(layout.image_key("j-1", name), png(i))
    made = views(Thumbnails(store), names)
    assert all(made) and len(store.reads) == 12 and 1 <= store.most <= THUMBS_AT_ONCE


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG that says it is ``width`` x ``height`` but holds one row of pixels (a few hundred bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = zlib.compress(b"\x00" + b"\x00\x00\x00" * width)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"tEXt", b"prompt\x00a huge one")
        + chunk(b"IDAT", row)
        + chunk(b"IEND", b"")
    )


def test_an_image_over_the_pixel_cap_gets_a_placeholder_from_its_header_alone() -> None:
    thumb, meta = make_thumbnail(huge_png_header(9000, 9000), "huge")
    assert thumb == placeholder() and meta["size"] == "9000x9000" and meta["prompt"] == "a huge one"
    assert "81.0 megapixels" in meta["preview"]  # refused before its pixels were read
    assert THUMB_MAX_PIXELS == 4096 * 4096  # the largest image a job may ask for passes
    assert "preview" in make_thumbnail(png(1), "small", max_pixels=64 * 32 - 1)[1]
    assert "preview" not in make_thumbnail(png(1), "small", max_pixels=64 * 32)[1]


@pytest.mark.parametrize(
    "data", [b"", b"not an image", png(1)[:100], b"GIF89a" + b"\x00" * 20, b"\x89PNG\r\n\x1a\n" + b"\x00" * 40]
)
def test_bytes_that_are_no_readable_png_jpeg_or_webp_get_a_placeholder(data: bytes) -> None:
    thumb, meta = make_thumbnail(data, "bad")
    assert thumb == placeholder() and "not a readable" in meta["preview"]


def test_a_jpeg_is_decoded_reduced_and_thumbnailed() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4096, 2048), (10, 200, 30)).save(buf, format="JPEG")
    with Image.open(io.BytesIO(buf.getvalue())) as image:
        image.draft("RGB", (384, 384))  # what make_thumbnail asks of the decoder
        assert image.size == (1024, 512)  # decoded at a quarter of the size: 1/16 of the memory
    thumb, meta = make_thumbnail(buf.getvalue(), "photo")
    with Image.open(io.BytesIO(thumb)) as im:
        assert im.size == (192, 96) and meta["size"] == "4096x2048" and "preview" not in meta


@pytest.mark.parametrize(("raw", "page"), [(None, 1), ("1", 1), ("2", 2), (str(MAX_PAGE), MAX_PAGE)])
def test_a_gallery_page_number_is_a_whole_number_in_range(raw: str | None, page: int) -> None:
    assert page_number(raw) == page


@pytest.mark.parametrize(
    "raw", ["", "0", "-1", "abc", "1e3", " 1", "1.0", "9223372036854775807", str(MAX_PAGE + 1), "\uff11", "1\x00"]
)
def test_any_other_page_is_a_bad_query(raw: str) -> None:
    with pytest.raises(BadQuery, match="page: a whole number"):
        page_number(raw)


# ---- the page's jobs: filtered, active first, 50 a page; its refresh only when something changed ----------


def _many_jobs() -> list[JobStatus]:
    done = [JobStatus(f"j-done-{i:04d}", 4, 4, 0, 0, 0, 1, 0, 0, True) for i in range(120)]
    live = [JobStatus(f"j-live-{i:04d}", 4, 1, 0, 3, 0, 1, 1, 0, True) for i in range(3)]
    failed = [JobStatus("j-failed-0000", 4, 0, 4, 0, 0, 1, 0, 0, True)]
    return done[:60] + live + done[60:] + failed


def test_the_page_lists_50_jobs_at_a_time_active_first_and_filters_by_state_and_id() -> None:
    from dispatcher.views.web import JOBS_PER_PAGE, JobsShown, jobs_shown

    jobs = _many_jobs()
    first, matching = jobs_shown(jobs, JobsShown())
    assert matching == 124 and len(first) == JOBS_PER_PAGE
    assert [j.job for j in first[:3]] == ["j-live-0000", "j-live-0001", "j-live-0002"]
    last, _ = jobs_shown(jobs, JobsShown(page=3))
    assert len(last) == 24 and last[-1].job == "j-failed-0000"
    assert [j.job for j in jobs_shown(jobs, JobsShown(show="active"))[0]] == ["j-live-0000", "j-live-0001", "j-live-0002"]
    assert [j.job for j in jobs_shown(jobs, JobsShown(show="failed"))[0]] == ["j-failed-0000"]
    assert jobs_shown(jobs, JobsShown(show="finished"))[1] == 120
    assert [j.job for j in jobs_shown(jobs, JobsShown(q="DONE-011"))[0]] == [f"j-done-011{i}" for i in range(10)]
    view = JobsShown.from_query({"show": "finished", "q": " x ", "page": "2"})
    assert view == JobsShown("finished", "x", 2) and view.query(page=3) == "?show=finished&q=x&page=3"
    assert JobsShown().query() == "?"
    for bad in ({"show": "everything"}, {"q": "x" * 101}, {"page": "0"}):
        with pytest.raises(BadQuery):
            JobsShown.from_query(bad)


def _call(
    app: Any, path: str, query: str = "", headers: dict[str, str] | None = None, *, client: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    """One GET through the ASGI application, from ``client`` (loopback unless told); a client that stays
    connected until the answer ends."""
    import asyncio

    sent: list[dict[str, Any]] = []
    asked = False
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(b"host", b"127.0.0.1")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": (client, 1),
        "server": ("127.0.0.1", 80),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if asked:  # a streamed answer listens for a disconnect: none comes
            await asyncio.sleep(3600)
        asked = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_the_pages_refresh_sends_its_pages_jobs_and_nothing_when_nothing_changed() -> None:
    from dispatcher.views.web import make_app

    fleet = FleetStatus(queues={}, jobs=_many_jobs(), store="/x")
    app = make_app(lambda: fleet, {}, None)
    status, headers, body = _call(app, "/api/page", "show=active")
    data = json.loads(body)
    assert status == 200 and data["matching"] == 3 and data["jobs"][0]["job"] == "j-live-0000"
    assert data["backlog_images"] == 9  # every job's backlog, not the page's
    everything = len(json.dumps(fleet.to_dict()))
    _, _, page = _call(app, "/api/page")
    assert len(page) < everything * 0.5  # 50 of 124 jobs
    again = _call(app, "/api/page", "show=active", {"If-None-Match": headers["etag"]})
    assert again[0] == 304 and again[2] == b""
    fleet.jobs[60] = JobStatus("j-live-0000", 4, 2, 0, 2, 0, 1, 1, 0, True)  # it moved
    assert _call(app, "/api/page", "show=active", {"If-None-Match": headers["etag"]})[0] == 200
    assert _call(app, "/api/page", "show=nope")[0] == 400
    html = _call(app, "/", "show=finished&page=2")[2].decode()
    assert "page 2 of 3" in html and 'href="?show=finished&amp;page=3"' in html and "j-done-0050" in html


def test_the_page_says_when_no_worker_serves_a_jobs_work_as_status_does() -> None:
    from dispatcher.views.web import make_app

    stuck = JobStatus("j-stuck", 4, 0, 0, 4, 0, 1, 0, 0, True)
    stuck.unserved, stuck.unserved_note = "none", "job j-stuck: no live worker serves its queue q: start one with X"
    app = make_app(lambda: FleetStatus(queues={}, jobs=[stuck], store="/x"), {}, None)
    assert "job j-stuck: no live worker serves its queue q: start one with X" in _call(app, "/")[2].decode()


def test_the_page_shows_a_mixed_fleets_cards_with_images_per_minute_and_cost_per_image() -> None:
    from dispatcher.views.web import make_app
    from renderfleet.cards import card_rows

    workers = [
        {"worker": "a", "pool": "l4", "card": "NVIDIA L4", "vram_gib": 22.5, "images": "300", "render_ms": "600000"},
        {"worker": "b", "pool": "h100", "card": "NVIDIA H100 80GB HBM3", "images": "1200", "render_ms": "480000"},
    ]
    fleet = FleetStatus(queues={}, workers=workers, store="/x", cards=card_rows(workers, {"l4": 0.8, "h100": 3.0}))
    page = _call(make_app(lambda: fleet, {}, None), "/")[2].decode()
    assert '<table class="cards">' in page and "<td>NVIDIA L4</td><td>22.5</td>" in page
    assert "<td>150</td><td>$0.333</td>" in page.replace("\n", ""), page  # per worker a minute; per 1,000 images


def test_event_streams_beyond_the_cap_are_told_to_come_back_not_given_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each open stream holds a thread of the server's pool while it waits on Redis: past the cap a new one
    # gets 503 with Retry-After before anything is read (the client below is never connected).
    import redis

    import dispatcher.views.web as web
    from renderfleet.store import LocalStore

    monkeypatch.setattr(web, "EVENTS_STREAMS_MAX", 0)
    app = web.make_app(
        lambda: FleetStatus(queues={}, jobs=[], store="/x"), {}, None, client=redis.Redis(port=1), store=LocalStore(tmp_path)
    )
    status, headers, body = _call(app, "/events")
    assert status == 503 and headers.get("retry-after") == "5" and b"event streams are open" in body


def test_a_last_event_id_past_what_redis_takes_is_a_400_not_an_error_in_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    import dispatcher.views.web as web

    assert web.last_event_id("18446744073709551615-18446744073709551615") == "18446744073709551615-18446744073709551615"
    for bad in ("99999999999999999999-0", "18446744073709551616-0", "0-18446744073709551616", "1" * 21 + "-0", "7"):
        with pytest.raises(BadQuery, match="Last-Event-ID"):
            web.last_event_id(bad)
    app = web.make_app(
        lambda: FleetStatus(queues={}, jobs=[], store="/x"), {}, None, client=redis.Redis(port=1), store=LocalStore(tmp_path)
    )
    status, _, body = _call(app, "/events", headers={"Last-Event-ID": "99999999999999999999-0"})
    assert status == 400 and b"Last-Event-ID" in body
    # A Redis that fails in the middle of a stream ends it (the browser reconnects), never an ASGI error.
    status, _, body = _call(app, "/events", headers={"Last-Event-ID": "0-0"})
    assert status == 200 and body == b"retry: 2000\n\n"


def test_one_client_holds_at_most_its_share_of_the_event_streams_whatever_form_its_address_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    import dispatcher.views.web as web

    entered, let_go = threading.Semaphore(0), threading.Event()

    def held_open(*args: Any, **kwargs: Any) -> Any:
        entered.release()
        yield "retry: 2000\n\n"
        let_go.wait(30)

    monkeypatch.setattr(web, "event_stream", held_open)
    app = web.make_app(
        lambda: FleetStatus(queues={}, jobs=[], store="/x"), {}, None, client=redis.Redis(port=1), store=LocalStore(tmp_path)
    )
    answers: list[tuple[str, int, dict[str, str]]] = []

    def open_stream(client: str) -> threading.Thread:
        def run() -> None:
            status, headers, _ = _call(app, "/events", client=client)
            answers.append((client, status, headers))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    try:
        holders = [open_stream("10.0.0.7") for _ in range(web.EVENTS_STREAMS_PER_CLIENT)]
        for _ in holders:
            assert entered.acquire(timeout=10)
        # the same client, as a dual-stack socket shows it: refused at once, told when to come back
        open_stream("::ffff:10.0.0.7").join(10)
        assert answers == [("::ffff:10.0.0.7", 429, answers[0][2])] and answers[0][2]["retry-after"] == "5"
        other = open_stream("10.0.0.8")
        assert entered.acquire(timeout=10)  # another client still gets a stream
    finally:
        let_go.set()
    for thread in [*holders, other]:
        thread.join(10)
    assert sorted(a[:2] for a in answers[1:]) == [("10.0.0.7", 200)] * 4 + [("10.0.0.8", 200)]
    again = open_stream("10.0.0.7")  # the streams ended gave their slots back
    again.join(10)
    assert answers[-1][:2] == ("10.0.0.7", 200)
