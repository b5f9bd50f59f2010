"""The commands on one job, or every job: ``status``, ``results``, ``resume``, ``cancel`` and
``delete``, and what they read beside the store (the Redis that knows a job, the prices)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from renderfleet.cli.common import _connect, _console, _err, _job_id, _settings, _user_errors
from renderfleet.cli.options import FLAG, ConfigOpt, JobArg
from renderfleet.errors import InputError, JobDeleted
from renderfleet.settings import Settings
from renderfleet.words import counted


def status(
    job: Annotated[
        str | None,
        typer.Argument(metavar="JOB", help="a job id, a unique prefix of one, or a job's name; all jobs when left out"),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", metavar=FLAG, help="one JSON object on stdout (docs/monitoring.md)")
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch", metavar=FLAG, help="redraw every 2 s until Ctrl-C (piped: a frame every 2 s)")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", metavar=FLAG, help="every column, however wide the terminal (lines may wrap)")
    ] = False,
    every: Annotated[
        bool, typer.Option("--all", metavar=FLAG, help="list every job, finished ones too (folded into one line without)")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Progress of a job (or every job): rate, ETA, cost; backlog, queues and workers.

    Active jobs come first; finished ones are folded into one line (--all lists them,
    --json always does), and --watch shows as many jobs as leave the queues and
    workers on the screen.

    Fits the terminal (80 columns included, and piped): a job shows by the shortest
    unique prefix of its id, which every command takes back; the least important
    columns are left out when they do not fit (--wide shows every one).  Costs use the
    pools' prices the fleet published (the autoscaler, a monitor or a worker with the
    config); --config gives them instead.
    """
    settings = _settings(config=config)
    from dispatcher.views.jobids import known_jobs, short_ids
    from renderfleet.store import open_store

    prices = settings.gpu_prices
    with _user_errors():
        _, client, _ = _connect(settings)
        store = open_store(settings.store_url, settings.s3_options)
        jobs = [_job_id(settings, job, client, store)] if job else None
        # A fleet that ran 10,000 jobs: the finished ones counted, not read (--json lists them all).
        view = _FleetView(client, store, prices, jobs, fold_finished=not (job or every or as_json))
        fleet = view.first_read(as_json=as_json)
        if as_json:
            print(json.dumps(fleet.to_dict()))
            return
        if watch:
            from dispatcher.views.show import watch as watch_status

            watch_status(view.frame, wide=wide, console=_console())
            return
        ids = short_ids(known_jobs(client, store, fleet.known))
    from dispatcher.views.show import print_status

    print_status(fleet, _console(), wide=wide, ids=ids)
    for reason, count in (fleet.jobs[0].failure_reasons or {}).items() if job else ():
        print(f"{count} prompt(s) failed: {reason}")


@dataclass(frozen=True)
class _FleetView:
    """What ``status`` reads each time it shows the fleet: these jobs (None: every one), the
    finished ones folded into a count or each read."""

    client: Any
    store: Any
    prices: dict[str, float]
    jobs: list[str] | None
    fold_finished: bool

    def read(self) -> Any:
        """The fleet's status now."""
        from dispatcher.status.status import fleet_status

        return fleet_status(
            self.client,
            self.jobs,
            store=self.store,
            prices=self.prices,
            with_store_only=True,
            served=True,
            fold_finished=self.fold_finished,
        )

    def first_read(self, *, as_json: bool) -> Any:
        """The first read.  A job deleted is raised (a message and exit 1), and with ``--json``
        the fleet is printed first with the job's tombstone in its list."""
        from dispatcher.status.status import deleted_job, fleet_status

        try:
            return self.read()
        except JobDeleted as gone:
            if as_json:
                data = fleet_status(self.client, [], store=self.store, prices=self.prices).to_dict()
                print(json.dumps({**data, "jobs": [deleted_job(gone)]}))
            raise

    def frame(self) -> tuple[Any, Any]:
        """A ``--watch`` frame: the status, and the ids of the jobs known then (a new job may lengthen some)."""
        from dispatcher.views.jobids import known_jobs, short_ids

        shown = self.read()
        return shown, short_ids(known_jobs(self.client, self.store, shown.known))


def results(
    job: JobArg,
    as_json: Annotated[bool, typer.Option("--json", metavar=FLAG, help="one JSON object on stdout")] = False,
    manifest: Annotated[
        Path | None,
        typer.Option("--manifest", metavar="FILE", help="write one row per prompt to a .parquet, .jsonl or .csv file"),
    ] = None,
    sheet: Annotated[
        Path | None, typer.Option("--contact-sheet", metavar="FILE", help="write a PNG grid of the first images")
    ] = None,
    first: Annotated[int, typer.Option("--first", metavar="N", help="images on the contact sheet")] = 100,
    config: ConfigOpt = None,
) -> None:
    """Where each prompt's image is, and which are missing or quarantined."""
    settings = _settings(config=config)
    from dispatcher.status.status import results as job_results
    from renderfleet.store import open_store

    with _user_errors():
        store = open_store(settings.store_url, settings.s3_options)
        job = _job_id(settings, job, store=store)
        if manifest or sheet:
            _write_job_files(settings, store, job, manifest, sheet, first)
            return
        names: list[str] = []  # the prompts' image names, from the one read of the prompt file
        corrected = _correct_counts(settings, store, job, names)
        # Each prompt's record (a read of each shard's checkpoints) in the JSON only: the lines list no more.
        prices = _prices(settings, store) if as_json else None
        res = job_results(store, job, names if corrected is not None else None, prices=prices)
    if corrected is not None and corrected.uncounted:
        _err(
            f"job {job}: {counted(corrected.uncounted, 'prompt')} counted done "
            f"{'has' if corrected.uncounted == 1 else 'have'} no image in the store: their counts are taken back"
        )
    _print_results(res, as_json=as_json)
    if res.missing:
        _err(f"renderfleet resume {job}: renders the missing ones (a running monitor does it by itself)")
        raise typer.Exit(1)  # a script can tell an unfinished job from a finished one


def _write_job_files(
    settings: Settings, store: Any, job: str, manifest: Path | None, sheet: Path | None, first: int
) -> None:
    """``results --manifest FILE`` and ``--contact-sheet FILE``: each file written, and what it holds said."""
    from dispatcher.views.manifest import contact_sheet, manifest_rows, write_manifest

    if manifest:
        sizes: list[int] = []

        def sized(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            for row in rows:
                if row["bytes"] is not None:
                    sizes.append(row["bytes"])
                yield row

        rows = manifest_rows(store, job, _attempts(settings, job), _prices(settings, store))
        n = write_manifest(sized(rows), manifest)
        mean = f", {sum(sizes) / len(sizes):,.0f} bytes per image (mean of {len(sizes)})" if sizes else ""
        _err(f"{manifest}: {n} rows{mean}")
    if sheet:
        _err(f"{sheet}: {counted(contact_sheet(store, job, sheet, limit=first), 'image')}")


def _print_results(res: Any, *, as_json: bool) -> None:
    """A job's results on stdout: one JSON object, or a line per image, quarantined and missing prompt
    (the counts on stderr)."""
    if as_json:
        print(json.dumps(res.to_dict()))
        return
    for name, where in res.images.items():
        print(f"{name}\t{where}")
    for name, error in res.quarantined.items():
        print(f"{name}\tQUARANTINED\t{error}")
    for name in res.missing:
        print(f"{name}\tMISSING")
    _err(f"{counted(len(res.images), 'image')}, {len(res.missing)} missing, {len(res.quarantined)} quarantined")


def _running_redis(settings: Settings) -> tuple[Any, Any] | None:
    """(celery app, redis client) of the configured Redis, or of the embedded one if it runs:
    never started just for a reader."""
    from renderfleet.celery_app import make_app
    from renderfleet.embedded import connect, running_embedded

    url = settings.redis_url or running_embedded(settings.home)
    return (make_app(url), connect(url)) if url else None


def _correct_counts(settings: Settings, store: Any, job: str, names: list[str] | None = None) -> Any:
    """Redis's counts of ``job`` corrected to the store (a count whose image is gone is taken
    back), when Redis knows the job: ``status`` then agrees with ``results``.  The report, or None;
    ``names`` is filled with the prompts' image names when it is not None (``resume``'s)."""
    from dispatcher.jobs.resume import resume as do_resume
    from renderfleet import keys

    found = _running_redis(settings)
    if found is None or not found[1].exists(keys.job(job)):
        return None
    return do_resume(job, store=store, app=found[0], client=found[1], push=False, names=names)


def _prices(settings: Settings, store: Any) -> dict[str, float]:
    """Each pool's price per hour, for the prompts' cost shares: those the fleet published (the
    configured Redis, or the embedded one if it runs), each overridden by the settings' config."""
    from dispatcher.jobs.prices import published_prices

    found = _running_redis(settings)
    published = published_prices(found[1], store.url) if found is not None else {}
    return {**published, **{name: p for name, p in settings.gpu_prices.items() if p > 0}}


def _attempts(settings: Settings, job: str) -> dict[int, int] | None:
    """Attempts per shard (the manifest's shard_attempts column), from the configured Redis or
    the embedded one if it runs (never started for this); None when no Redis knows the job."""
    from renderfleet import keys

    found = _running_redis(settings)
    if found is None or not found[1].exists(keys.job(job)):
        return None
    return {int(k): int(v) for k, v in found[1].hgetall(keys.attempts(job)).items()}


def resume(
    job: JobArg,
    budget: Annotated[
        float | None,
        typer.Option("--budget", metavar="USD", help="the job's new budget: continues a job stopped at its budget"),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Enqueue whatever of a job is not yet in the store (Redis may have been lost)."""
    settings = _settings(config=config)
    from dispatcher.jobs.lifecycle import deleted
    from dispatcher.jobs.prices import publish_prices, published_prices
    from dispatcher.jobs.resume import resume as do_resume
    from renderfleet.store import open_store

    with _user_errors():
        celery, client, _ = _connect(settings)
        store = open_store(settings.store_url, settings.s3_options)
        job = _job_id(settings, job, client, store)
        if (gone := deleted(client, job)) is not None:
            raise gone
        prices = {name: p for name, p in settings.gpu_prices.items() if p > 0}
        publish_prices(client, store.url, prices)  # a Redis that lost them has them again: every view agrees
        prices = {**published_prices(client, store.url), **prices} if budget is not None else prices
        report = do_resume(job, store=store, app=celery, client=client, uncancel=True, budget=budget, prices=prices)
    # Nothing enqueued while prompts lack an image: they are in shards already pending, queued
    # or leased (resume never adds a second copy), which "0 shards enqueued" alone hides.
    to_render = report.total - report.done - report.quarantined
    waiting = (
        f"; {counted(to_render, 'prompt')} to render {'is' if to_render == 1 else 'are'} already queued or running"
        if to_render > 0 and report.shards_enqueued == 0
        else ""
    )
    _err(
        f"job {job}: {report.done}/{report.total} in the store, {report.quarantined} quarantined, "
        f"{counted(report.shards_enqueued, 'shard')} enqueued"
        + (" (counters rebuilt)" if report.rebuilt_counters else "")
        + waiting
        + (
            f"; {counted(report.uncounted, 'counted prompt')} had no image: counted again once rendered"
            if report.uncounted
            else ""
        )
    )
    print(job)


def cancel(job: JobArg, config: ConfigOpt = None) -> None:
    """Stop a job: its queued shards leave the queue, running ones stop at their next batch. `resume` continues it."""
    settings = _settings(config=config)
    from renderfleet.api import Client

    with _user_errors():
        handle = Client(settings).job(job)
        job = handle.id
        done = handle.cancel()
        st = handle.status()
    _err(
        f"job {job} cancelled: {st.done}/{st.total} rendered; {done.removed} queued message(s) removed, "
        f"{done.parked} shard(s) parked"
        + (f", {done.leased} running shard(s) stop at their next batch" if done.leased else "")
        + f"; `renderfleet resume {job}` continues it"
    )
    print(job)


def delete(
    job: JobArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", metavar=FLAG, help="do not ask (needed without a terminal)")] = False,
    config: ConfigOpt = None,
) -> None:
    """Cancel a job, then remove it: its images, checkpoints and every file of it in the store, and its Redis keys."""
    settings = _settings(config=config)
    from dispatcher.jobs.lifecycle import delete as do_delete
    from renderfleet.api import Client
    from renderfleet.spec import job_prefix

    with _user_errors():
        client = Client(settings)
        job = _job_id(settings, job, store=client.store)
        where = client.store.locate(job_prefix(job))
        if not yes:
            if not sys.stdin.isatty():
                raise InputError([f"delete {job}: would remove {where}; refusing without --yes (no terminal to ask on)"])
            if not typer.confirm(f"Delete job {job}: everything under {where}, and its records in Redis?"):
                _err("nothing deleted")
                raise typer.Exit(1)

        def waiting(leases: int, seconds: float) -> None:
            _err(f"waiting for {leases} running shard(s), fenced, to let go of their leases (at most {seconds:.0f} s)")

        report = do_delete(
            job, store=client.store, client=client.redis, lease_seconds=settings.lease_seconds, on_wait=waiting
        )
    _err(
        f"job {job} deleted: {report.objects} object(s) removed from {where}"
        + (f" ({report.stragglers} written after the first pass)" if report.stragglers else "")
        + "; its Redis keys are gone (a tombstone says so for a day)"
    )
    print(job)
