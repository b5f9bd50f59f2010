"""The monitor's web page: the fleet at a glance, each job, its quarantine and a paged gallery.

A Starlette app with Jinja2 templates rendered on the server; a few lines of
plain JavaScript (``static/live.js``, no build step, nothing from a CDN) poll
``/api/status`` to keep the figures live.  Everything is read from Redis and
the store at request time; the charts come from samples the HTTP endpoint's
sampler writes to capped Redis lists (``rf:history:<store tag>:<metric>``), so a
restart of the monitor keeps the last hour.  Everything shown is one store's.

Every job id and image name taken from a URL is checked (the job id's shape,
then the job's spec in the store; an image name's shape, then the image in the
store) before it becomes a store key: no URL reaches outside a job's prefix.
Nor do the bytes behind a key: a folder store follows no symbolic link below
its root (``renderfleet.store.LocalStore``), so a link planted among a job's
images is a 404 and a linked ``thumbs/`` gets nothing written through it.

Nothing happens at import: :func:`make_app` builds the application.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import redis
from jinja2.exceptions import UndefinedError
from markupsafe import Markup, escape
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp

from dispatcher.fleet.fleetmetrics import FleetCollector, StatusSource
from dispatcher.jobs.resume import image_key_of
from dispatcher.status.status import FleetStatus, JobStatus, fleet_status
from dispatcher.views.jobids import resolve
from dispatcher.views.show import ago, money
from dispatcher.views.thumbs import NoImage, Thumbnails
from renderfleet import keys
from renderfleet import spec as layout
from renderfleet.endpoint import IMAGE_CSP, client_key, guard
from renderfleet.errors import InputError, JobNotFound, StoreError
from renderfleet.limits import MAX_IMAGE_BYTES, MAX_QUARANTINE_RECORD_BYTES
from renderfleet.settings import PoolConfig
from renderfleet.spec import job_id_problem, name_problem, store_tag
from renderfleet.store import Store, read_record

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
PAGE_SIZE = 60  # images per gallery page
QUARANTINE_SHOWN = 100  # quarantined prompts listed on a job's page
IMAGE_HEADERS = {"Cache-Control": "private, max-age=86400", "Content-Security-Policy": IMAGE_CSP}
MAX_PAGE = 10**8  # a gallery page number from a URL: 6e9 images before it, more than any job holds
HISTORY_WINDOW = 3600.0  # seconds the charts cover
SAMPLE_SECONDS = 5.0  # how often the sampler records the fleet's figures


# ---- history: capped Redis lists, one per metric ------------------------------------


def samples(fleet: FleetStatus) -> dict[str, float]:
    """The figures charted, from one status read: queue depth, backlog, pool sizes (bounded: one per pool),
    Redis's CPU (a percentage of a core, once known)."""
    out = {
        "queue_shards": float(sum(fleet.queues.values()) + sum(fleet.pending.values())),
        "backlog_images": float(sum(j.to_render for j in fleet.jobs)),
        "backlog_seconds": float(fleet.backlog_seconds),
    }
    sizes = fleet.pool_sizes()
    for pool in sorted(set(sizes) | set(fleet.desired)):
        out[f"workers.{pool}"] = float(sizes.get(pool, 0))
    for pool, n in fleet.desired.items():  # only where an autoscaler decided
        out[f"desired.{pool}"] = float(n)
    if fleet.redis is not None and fleet.redis.cpu_share is not None:
        out["redis_cpu"] = round(100 * fleet.redis.cpu_share, 1)
    return out


def record(client: redis.Redis, fleet: FleetStatus, now: float | None = None) -> None:
    """Append one sample per metric to its capped list (newest first), under the fleet's store."""
    now = time.time() if now is None else now
    tag = store_tag(fleet.store)
    pipe = client.pipeline(transaction=False)
    for metric, value in samples(fleet).items():
        pipe.lpush(keys.history(metric, tag), f"{now:.3f} {value:g}")
        pipe.ltrim(keys.history(metric, tag), 0, keys.HISTORY_KEEP - 1)
        pipe.expire(keys.history(metric, tag), int(HISTORY_WINDOW * 24))
    pipe.execute()


def read_history(
    client: redis.Redis, metrics: list[str], store: str, now: float | None = None
) -> dict[str, list[tuple[float, float]]]:
    """Each metric's samples of the last hour for ``store`` (a URL), oldest first."""
    now = time.time() if now is None else now
    tag = store_tag(store)
    pipe = client.pipeline(transaction=False)
    for metric in metrics:
        pipe.lrange(keys.history(metric, tag), 0, keys.HISTORY_KEEP - 1)
    out: dict[str, list[tuple[float, float]]] = {}
    for metric, raw in zip(metrics, pipe.execute(), strict=True):
        points = []
        for item in raw:
            try:  # a sample written by anyone but the sampler is skipped: not text, numbers, or finite
                t, _, v = keys.text(item).partition(" ")
                point = (float(t), float(v))
            except ValueError:
                continue
            if math.isfinite(point[0]) and math.isfinite(point[1]) and point[0] >= now - HISTORY_WINDOW:
                points.append(point)
        out[metric] = sorted(points)
    return out


def history_metrics(client: redis.Redis, store: str) -> list[str]:
    """``store``'s metrics with samples (pools come and go): one SCAN of its history prefix."""
    prefix = keys.history_prefix(store_tag(store))
    found = set()
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        try:
            found.add(keys.text(key)[len(prefix) :])
        except UnicodeDecodeError:  # not UTF-8: no metric the sampler wrote
            continue
    return sorted(found)


class Sampler:
    """Records the fleet's figures every ``SAMPLE_SECONDS`` in a daemon thread (started by :meth:`start`)."""

    def __init__(self, client: redis.Redis, source: StatusSource, every: float = SAMPLE_SECONDS):
        self.client, self.source, self.every = client, source, every
        self.stopped = threading.Event()

    def start(self) -> Sampler:
        threading.Thread(target=self.run, name="rf-http-sampler", daemon=True).start()
        return self

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                record(self.client, self.source())
            except (redis.RedisError, StoreError, OSError) as exc:
                log.warning("monitor: cannot record the fleet's history now: %s", exc)
            self.stopped.wait(self.every)


# ---- inline SVG charts, drawn here --------------------------------------------------

COLOURS = ("#2f6fdf", "#e07b00", "#2a9d55", "#b03ab0")


def svg_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    now: float | None = None,
    width: int = 360,
    height: int = 120,
    since: float | None = None,
) -> Markup:
    """A line chart of the last hour as inline SVG: one polyline per series, the y axis from 0 to the top value."""
    now = time.time() if now is None else now
    # The last hour, or less while the history is younger: a fresh monitor's few minutes fill the width.
    first = since if since is not None else min((t for pts in series.values() for t, _ in pts), default=now - HISTORY_WINDOW)
    span = max(60.0, min(HISTORY_WINDOW, now - first))
    pad_l, pad_r, pad_t, pad_b = 44, 8, 18, 16
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    top = max([v for pts in series.values() for _, v in pts] + [1.0])
    top = _nice(top)

    def x(t: float) -> float:
        return pad_l + w * max(0.0, min(1.0, 1 - (now - t) / span))

    def y(v: float) -> float:
        return pad_t + h * (1 - v / top)

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<text x="{pad_l}" y="12" class="chart-title">{escape(title)}</text>',
        f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" class="chart-bg"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        line_y = pad_t + h * (1 - frac)
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{line_y:.1f}" y2="{line_y:.1f}" class="grid"/>')
        parts.append(
            f'<text x="{pad_l - 4}" y="{line_y + 4:.1f}" class="axis" text-anchor="end">{_short(top * frac)}</text>'
        )
    parts.append(f'<text x="{pad_l}" y="{height - 3}" class="axis">-{_duration(span)}</text>')
    parts.append(f'<text x="{pad_l + w}" y="{height - 3}" class="axis" text-anchor="end">now</text>')
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        if len(pts) == 1:
            parts.append(f'<circle cx="{x(pts[0][0]):.1f}" cy="{y(pts[0][1]):.1f}" r="2" fill="{colour}"/>')
        elif pts:
            line = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
            parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if len(series) > 1:
            parts.append(
                f'<text x="{pad_l + w - 4}" y="{pad_t + 12 + 12 * i}" class="legend" text-anchor="end" '
                f'fill="{colour}">{escape(name)}</text>'
            )
    if not any(series.values()):
        parts.append(
            f'<text x="{pad_l + w / 2}" y="{pad_t + h / 2}" class="axis" text-anchor="middle">no samples yet</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def _nice(v: float) -> float:
    mag = 10 ** math.floor(math.log10(v))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= v)


def _short(v: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if v >= size:
            return f"{v / size:g}{unit}"
    return f"{v:g}"


def charts(client: redis.Redis, store: str, now: float | None = None) -> list[Markup]:
    """``store``'s queue depth, backlog in images and in seconds of work, each pool's size
    against its desired size, and Redis's main thread's share of a core."""
    now = time.time() if now is None else now
    metrics = history_metrics(client, store)
    hist = read_history(client, metrics, store, now)
    since = min((pts[0][0] for pts in hist.values() if pts), default=None)  # one time axis for every chart
    out = [
        svg_chart("queue depth (shards)", {"shards": hist.get("queue_shards", [])}, now, since=since),
        svg_chart("backlog (images)", {"images": hist.get("backlog_images", [])}, now, since=since),
        svg_chart("backlog (seconds of work)", {"seconds": hist.get("backlog_seconds", [])}, now, since=since),
    ]
    pools = sorted({m.partition(".")[2] for m in metrics if m.startswith(("workers.", "desired."))})
    for pool in pools:
        series = {"up": hist.get(f"workers.{pool}", [])}
        if hist.get(f"desired.{pool}"):
            series["desired"] = hist[f"desired.{pool}"]
        out.append(svg_chart(f"pool {pool}: workers", series, now, since=since))
    if hist.get("redis_cpu"):
        out.append(svg_chart("Redis main thread (% of a core)", {"cpu": hist["redis_cpu"]}, now, since=since))
    return out


# ---- the job: checked ids, gallery pages (thumbnails: dispatcher/views/thumbs.py) ----------


class NotHere(Exception):
    """A URL that names no job, or no image of the job: 404."""


class BadQuery(Exception):
    """A query parameter that is not what the page takes: 400."""


def page_number(raw: str | None) -> int:
    """The gallery page asked for: a whole number from 1 to ``MAX_PAGE`` (1 when not given); BadQuery otherwise."""
    if raw is None:
        return 1
    if not re.fullmatch(r"[0-9]{1,9}", raw) or not 1 <= int(raw) <= MAX_PAGE:
        raise BadQuery(f"page: a whole number from 1 to {MAX_PAGE}, got {raw[:20]!r}")
    return int(raw)


# ---- the page's jobs: filtered, active first, a page at a time ------------------------

JOBS_PER_PAGE = 50
SHOWN = ("all", "active", "finished", "failed")  # which jobs the page lists (?show=)
MAX_FILTER = 100  # characters of ?q=


@dataclass(frozen=True)
class JobsShown:
    """Which jobs the page lists: ``show`` (one of :data:`SHOWN`), ``q`` (a piece of the id or name, any case), ``page``."""

    show: str = "all"
    q: str = ""
    page: int = 1

    @classmethod
    def from_query(cls, params: Mapping[str, str]) -> JobsShown:
        show = params.get("show") or "all"
        if show not in SHOWN:
            raise BadQuery(f"show: one of {', '.join(SHOWN)}, got {show[:20]!r}")
        q = params.get("q", "")
        if len(q) > MAX_FILTER:
            raise BadQuery(f"q: at most {MAX_FILTER} characters")
        return cls(show, q.strip(), page_number(params.get("page")))

    def query(self, **change: Any) -> str:
        """This view's query string, with ``change`` applied (the page's links)."""
        fields = {"show": self.show, "q": self.q, "page": self.page, **change}
        return "?" + urlencode({k: v for k, v in fields.items() if v not in ("", "all", 1)})


def _shown(job: JobStatus, show: str) -> bool:
    state = job.state
    if show == "active":
        return state in ("running", "waiting", "budget", "cancelled") and not job.finished
    return show == "all" or state == show


def jobs_shown(jobs: list[JobStatus], view: JobsShown) -> tuple[list[JobStatus], int]:
    """The jobs of ``view``'s page, active ones first, and how many match in all: a fleet that has run
    thousands of jobs is listed 50 at a time, not drawn whole at every view and refresh."""
    needle = view.q.lower()
    matching = [j for j in jobs if _shown(j, view.show) and (needle in j.job.lower() or needle in j.name.lower())]
    matching.sort(key=lambda j: j.finished or j.state == "failed")  # stable: the fleet's order within each
    start = (view.page - 1) * JOBS_PER_PAGE
    return matching[start : start + JOBS_PER_PAGE], len(matching)


def checked_job(store: Store, job: str, client: redis.Redis | None = None) -> str:
    """``job`` when it is a job id the store holds, or the one such job whose id starts with it (a
    short id as ``status`` shows it, ``dispatcher.views.jobids``) or whose name it is; NotHere otherwise,
    naming the candidates of an ambiguous prefix or name."""
    if job_id_problem(job) and layout.job_name_problem(job):
        raise NotHere(f"no job {job!r}")
    if job_id_problem(job) or not store.exists(layout.spec_key(job)):
        try:
            job = resolve(client, store, job)
        except (InputError, JobNotFound) as exc:  # ambiguous, or none (a deleted job's has no spec either)
            raise NotHere(str(exc)) from None
        if not store.exists(layout.spec_key(job)):
            raise NotHere(f"no job {job!r}")
    return job


def checked_image(store: Store, job: str, name: str) -> str:
    """``name`` when it is an image the job has (in any format); NotHere otherwise."""
    if name_problem(name) or image_key_of(store, job, name) is None:
        raise NotHere(f"job {job} has no image {name!r}")
    return name


def _names(store: Store, prefix: str, suffix: str) -> Iterator[str]:
    for key in store.list(prefix):
        if key.endswith(suffix):
            yield key[len(prefix) : -len(suffix)]


def _image_names(store: Store, prefix: str) -> Iterator[str]:
    for key in store.list(prefix):
        if (name := layout.image_name(key[len(prefix) :])) is not None:
            yield name


def gallery_page(store: Store, job: str, page: int) -> tuple[list[str], bool]:
    """One page of the job's image names, in the store's sorted order, and whether a next page exists.

    The listing is a lazy iterator: a page reads only as far as its last name
    (on S3, a 1000-key listing page at a time), never the whole job.
    """
    start = (page - 1) * PAGE_SIZE
    names = list(islice(_image_names(store, layout.images_prefix(job)), start, start + PAGE_SIZE + 1))
    return names[:PAGE_SIZE], len(names) > PAGE_SIZE


def quarantined(store: Store, job: str, limit: int = QUARANTINE_SHOWN) -> list[dict[str, Any]]:
    """The first ``limit`` quarantined prompts of the job, each with its error."""
    prefix = f"{layout.job_prefix(job)}quarantine/"
    out = []
    for name in islice(_names(store, prefix, ".json"), limit):
        raw = read_record(store, layout.quarantine_key(job, name), MAX_QUARANTINE_RECORD_BYTES)
        try:
            record = json.loads(raw) if raw else {}
        except ValueError:
            record = {}
        out.append(
            {
                "name": name,
                "prompt": record.get("prompt", ""),
                "seed": record.get("seed"),
                "error": record.get("error", "quarantined"),
                "failures": record.get("failures"),
            }
        )
    return out


# ---- live events: server-sent, from the store's stream (dispatcher/events/events.py) -------------

EVENTS_REPLAY = 100  # events a new connection gets first: the latest (of its job)
EVENTS_SCAN = 2000  # stream entries looked through for them
EVENTS_CONNECTION_SECONDS = 300.0  # a connection ends after this; the browser reconnects with Last-Event-ID
EVENTS_KEEPALIVE_SECONDS = 15.0  # a comment line this often: proxies keep a quiet connection open
EVENTS_BLOCK_MS = 500  # one read's wait for a new event (under the Redis client's socket timeout)
# Open event streams at once, each holding a thread of the server's pool (40) while it waits on Redis:
# beyond this many a new one is told to come back (503), so open pages never starve the other endpoints.
EVENTS_STREAMS_MAX = 16
# Open event streams of one client address: one client (a script reconnecting in a loop, a page opened in
# many tabs) cannot take all of EVENTS_STREAMS_MAX; beyond this many it is told to come back (429).
EVENTS_STREAMS_PER_CLIENT = 4
EVENTS_RETRY_AFTER = "5"  # seconds a stream refused is told to wait
_STREAM_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_STREAM_ID_PART_MAX = 2**64 - 1  # each part of a Redis stream id is an unsigned 64-bit number


def last_event_id(raw: str | None) -> str | None:
    """A reconnecting client's ``Last-Event-ID`` (a stream entry's id), or None; BadQuery when it is not one
    (twenty digits past 2**64 too: Redis would refuse it in the middle of the stream)."""
    if raw is None or raw == "":
        return None
    found = _STREAM_ID.fullmatch(raw)
    if found is None or max(int(found[1]), int(found[2])) > _STREAM_ID_PART_MAX:
        raise BadQuery(f"Last-Event-ID: a stream id such as 1718000000000-0, got {raw[:40]!r}")
    return raw


class StreamSlots:
    """The event streams open now: at most :data:`EVENTS_STREAMS_MAX` in all and
    :data:`EVENTS_STREAMS_PER_CLIENT` per client address (``renderfleet.endpoint.client_key``: an IPv4
    client seen as ``::ffff:a.b.c.d`` is the same client).  Behind a reverse proxy every client is the
    proxy's address: the proxy's own limits are the ones per user then."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, int] = {}

    def take(self, client: str) -> tuple[int, str] | None:
        """A slot for ``client`` (None), or the status and reason it is refused with."""
        with self.lock:
            if self.open.get(client, 0) >= EVENTS_STREAMS_PER_CLIENT:
                return 429, f"busy: this client has {EVENTS_STREAMS_PER_CLIENT} event streams open"
            if sum(self.open.values()) >= EVENTS_STREAMS_MAX:
                return 503, f"busy: {EVENTS_STREAMS_MAX} event streams are open"
            self.open[client] = self.open.get(client, 0) + 1
            return None

    def releaser(self, client: str) -> Callable[[], None]:
        """Gives ``client``'s slot back, once however often called (the stream's end, and its collection
        for a stream never started: a client gone before the first byte)."""
        done = threading.Event()

        def release() -> None:
            with self.lock:
                if done.is_set():
                    return
                done.set()
                if (left := self.open.get(client, 0) - 1) > 0:
                    self.open[client] = left
                else:
                    self.open.pop(client, None)

        return release


def _sse(entry_id: Any, fields: dict[Any, Any]) -> str:
    """One entry of the stream as a server-sent event: its stream id, its type, its JSON."""
    kind = keys.text(fields.get(b"type", fields.get("type", "")))
    data = keys.text(fields.get(b"event", fields.get("event", "")))
    return f"id: {keys.text(entry_id)}\nevent: {kind}\ndata: {data}\n\n"


def _of_job(fields: dict[Any, Any], job: str | None) -> bool:
    return job is None or keys.text(fields.get(b"job", fields.get("job", ""))) == job


def event_stream(
    client: redis.Redis,
    store: str,
    job: str | None,
    last: str | None,
    *,
    seconds: float = EVENTS_CONNECTION_SECONDS,
    clock: Any = time.monotonic,
) -> Iterator[str]:
    """The server-sent events of ``store``'s jobs (``job``'s alone when named): after ``last`` (a stream id),
    or the latest :data:`EVENTS_REPLAY` then what comes, for ``seconds``."""
    stream = keys.events_stream(store_tag(store))
    yield "retry: 2000\n\n"
    if last is None:
        recent = cast(list[tuple[Any, dict[Any, Any]]], client.xrevrange(stream, count=EVENTS_SCAN))
        shown = [(i, f) for i, f in reversed(recent) if _of_job(f, job)][-EVENTS_REPLAY:]
        yield from (_sse(i, f) for i, f in shown)
        last = keys.text(recent[0][0]) if recent else "0-0"
    end, quiet_since = clock() + seconds, clock()
    while clock() < end:
        reply = cast(
            list[tuple[Any, list[tuple[Any, dict[Any, Any]]]]],
            client.xread({stream: last}, count=100, block=EVENTS_BLOCK_MS),
        )
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = keys.text(entry_id)
                if _of_job(fields, job):
                    quiet_since = clock()
                    yield _sse(entry_id, fields)
        if clock() - quiet_since >= EVENTS_KEEPALIVE_SECONDS:
            quiet_since = clock()
            yield ": keep-alive\n\n"


# ---- the application ----------------------------------------------------------------


def _job_view(job_state: JobStatus) -> dict[str, Any]:
    """The job's JSON object (``JobStatus.to_dict``): what the page shows and /api/ serves."""
    return job_state.to_dict()


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _seen(last_seen: Any) -> str:
    """A worker's state from its heartbeat: up, or silent for how long."""
    try:
        age = time.time() - float(last_seen)
    except (TypeError, ValueError, UndefinedError):  # a registration without one (Jinja's Undefined), or not a time
        return "-"
    return "up" if age < 30 else f"silent {_duration(age)}"


def _ago(when: float | None) -> str:
    """When a job was submitted, as an age (``3h05m ago``); ``-`` when not known."""
    return "-" if not when else f"{ago(when)} ago"


def _utc(when: float | None) -> str:
    """A unix time as a person reads it, in UTC; ``not known`` for none."""
    return "not known" if not when else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))


def _money(value: float | None) -> str:
    return money(value, "$")


def page_templates() -> Jinja2Templates:
    """The pages' templates (dispatcher/templates) with the filters they use."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["duration"] = _duration
    templates.env.filters["money"] = _money
    templates.env.filters["seen"] = _seen
    templates.env.filters["ago"] = _ago
    templates.env.filters["utc"] = _utc
    return templates


class _Monitor:
    """The monitor's request handlers over one fleet (its status, Redis, store, prices), one method
    per route; :meth:`routes` is the table :func:`make_app` serves, grouped as the page, its API,
    the images and the events."""

    def __init__(
        self,
        source: StatusSource,
        prices: dict[str, float],
        registry: CollectorRegistry,
        *,
        client: redis.Redis | None,
        store: Store | None,
        pools: Mapping[str, PoolConfig] | None,
    ):
        self.source, self.prices, self.registry = source, prices, registry
        self.client, self.store, self.pools = client, store, pools
        self.templates = page_templates()
        self.thumbs = Thumbnails(store) if store is not None else None
        self.slots = StreamSlots()

    def routes(self) -> list[Route | Mount]:
        """Every path the monitor answers, and its handler."""
        return [
            Route("/", self.index),
            Route("/metrics", self.metrics),
            Route("/api/status", self.api_status),
            Route("/api/page", self.api_page),
            Route("/api/autoscale", self.api_autoscale),
            Route("/api/jobs/{job}", self.api_job),
            Route("/api/jobs/{job}/images/{name}", self.api_image),
            Route("/jobs/{job}", self.job_page),
            Route("/events", self.events),
            Route("/jobs/{job}/events", self.events),
            Route("/jobs/{job}/thumbs/{name}", self.thumb),
            Route("/jobs/{job}/images/{name}", self.image),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ]

    def need_store(self) -> Store:
        if self.store is None:
            raise NotHere("this endpoint serves no store")
        return self.store

    def need_thumbs(self) -> Thumbnails:
        if self.thumbs is None:
            raise NotHere("this endpoint serves no store")
        return self.thumbs

    # ---- the page and a job's page ----

    def index(self, request: Request) -> Response:
        fleet = self.source()
        view = JobsShown.from_query(request.query_params)
        shown, matching = jobs_shown(fleet.jobs, view)
        return self.templates.TemplateResponse(
            request,
            "index.html",
            {
                "fleet": fleet,
                "jobs": [_job_view(j) for j in shown],
                "view": view,
                "shown_states": SHOWN,
                "matching": matching,
                "last_page": max(1, -(-matching // JOBS_PER_PAGE)),
                "backlog_images": sum(j.to_render for j in fleet.jobs),
                "pool_sizes": fleet.pool_sizes(),
                "charts": charts(self.client, fleet.store) if self.client is not None else [],
                "priced": any(p > 0 for p in fleet.prices.values()),
            },
        )

    def job_data(self, request: Request) -> dict[str, Any]:
        """A job's page as data: its status, one page of its gallery, its quarantined prompts."""
        store = self.need_store()
        job = checked_job(store, request.path_params["job"], self.client)
        page = page_number(request.query_params.get("page"))
        if self.client is None:
            raise NotHere("this endpoint serves no job pages")
        try:
            fleet = fleet_status(self.client, [job], store=store, prices=self.prices)
        except JobNotFound as exc:
            raise NotHere(str(exc)) from exc
        status = fleet.jobs[0]
        names, more = gallery_page(store, job, page)
        pages = max(1, -(-status.done // PAGE_SIZE))
        return {
            "job": _job_view(status),
            "page": page,
            "pages": max(pages, page + 1 if more else page),
            "page_size": PAGE_SIZE,
            "images": names,
            "more": more,
            "quarantined": quarantined(store, job),
            "priced": any(p > 0 for p in fleet.prices.values()),
        }

    def job_page(self, request: Request) -> Response:
        data = self.job_data(request)
        return self.templates.TemplateResponse(request, "job.html", data)

    # ---- the API: /metrics, /api/ ----

    def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def api_status(self, request: Request) -> Response:
        return JSONResponse(self.source().to_dict())

    def api_page(self, request: Request) -> Response:
        """The page's live refresh: the fleet's figures and the jobs of the page it shows (its query), with
        an ETag: nothing changed since the page's last poll (If-None-Match) is a 304 with no body."""
        fleet = self.source()
        view = JobsShown.from_query(request.query_params)
        shown, matching = jobs_shown(fleet.jobs, view)
        data = fleet.to_dict()
        data["jobs"], data["matching"] = [j.to_dict() for j in shown], matching
        data["backlog_images"] = sum(j.to_render for j in fleet.jobs)  # every job's, not the page's
        body = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        tag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        if request.headers.get("if-none-match") == tag:
            return Response(status_code=304, headers={"ETag": tag})
        return Response(body, media_type="application/json", headers={"ETag": tag})

    def api_autoscale(self, request: Request) -> Response:
        from dispatcher.fleet.backends import autoscale_answer

        return JSONResponse(autoscale_answer(self.source(), self.pools))

    def api_job(self, request: Request) -> Response:
        data = self.job_data(request)
        del data["priced"]
        return JSONResponse(data)

    def api_image(self, request: Request) -> Response:
        _, job, name = self.image_parts(request)
        return JSONResponse(self.need_thumbs().meta(job, name))

    # ---- a job's images and thumbnails ----

    def image_parts(self, request: Request) -> tuple[Store, str, str]:
        store = self.need_store()
        job = checked_job(store, request.path_params["job"])
        return store, job, checked_image(store, job, request.path_params["name"])

    def thumb(self, request: Request) -> Response:
        _, job, name = self.image_parts(request)
        return Response(self.need_thumbs().thumbnail(job, name), media_type="image/webp", headers=IMAGE_HEADERS)

    def image(self, request: Request) -> Response:
        store = self.need_store()
        job = checked_job(store, request.path_params["job"])
        name = request.path_params["name"]
        key = None if name_problem(name) else image_key_of(store, job, name)
        data = None if key is None else read_record(store, key, MAX_IMAGE_BYTES)
        if key is None or data is None:
            raise NotHere(f"job {job} has no image {name!r}")
        media = layout.CONTENT_TYPES.get(key.rpartition(".")[2], "application/octet-stream")
        return Response(data, media_type=media, headers=IMAGE_HEADERS)

    # ---- live events ----

    def events(self, request: Request) -> Response:
        """Server-sent events of the store's jobs (``/events``) or one job's (``/jobs/JOB/events``)."""
        store = self.need_store()
        client = self.client
        if client is None:
            raise NotHere("this endpoint serves no events")
        job = request.path_params.get("job")
        if job is not None:
            job = checked_job(store, job, client)
        last = last_event_id(request.headers.get("last-event-id") or request.query_params.get("last"))
        who = client_key(request.client.host if request.client is not None else "")
        if (refused := self.slots.take(who)) is not None:
            status, why = refused
            return PlainTextResponse(
                f"{why}; try again shortly\n", status_code=status, headers={"Retry-After": EVENTS_RETRY_AFTER}
            )
        release = self.slots.releaser(who)

        def held() -> Iterator[str]:
            try:
                yield from event_stream(client, store.url, job, last)
            except redis.RedisError as exc:  # the stream ends; the browser reconnects with its Last-Event-ID
                log.warning("events stream: Redis: %s", exc)
            finally:
                release()

        body = held()
        weakref.finalize(body, release)
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _not_here(request: Request, exc: Exception) -> Response:
    return PlainTextResponse(f"not found: {exc}\n", status_code=404)


async def _bad_query(request: Request, exc: Exception) -> Response:
    return PlainTextResponse(f"bad request: {exc}\n", status_code=400)


async def _not_found(request: Request, exc: Exception) -> Response:
    return PlainTextResponse(
        "not found: /, /jobs/JOB, /events, /jobs/JOB/events, /metrics, /api/status, /api/autoscale, /api/jobs/JOB\n",
        status_code=404,
    )


def make_app(
    source: StatusSource,
    prices: dict[str, float],
    token: str | None,
    *,
    client: redis.Redis | None = None,
    store: Store | None = None,
    registry: CollectorRegistry | None = None,
    hosts: tuple[str, ...] = (),
    tls_proxy: bool = False,
    pools: Mapping[str, PoolConfig] | None = None,
) -> ASGIApp:
    """The ASGI application: the page, the job pages and gallery, /api/, /metrics; behind the token when
    given, else answering only a loopback Host or one of ``hosts`` (:func:`renderfleet.endpoint.guard`)."""
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FleetCollector(source, prices))  # type: ignore[arg-type]
    monitor = _Monitor(source, prices, registry, client=client, store=store, pools=pools)
    app: ASGIApp = Starlette(
        routes=monitor.routes(),
        exception_handlers={NotHere: _not_here, NoImage: _not_here, BadQuery: _bad_query, 404: _not_found},
    )
    return guard(app, token, hosts=hosts, tls_proxy=tls_proxy)
