"""What ``status`` draws, without a fleet: short ids, costs never rounded to nothing, the bar, tables that fit."""

from __future__ import annotations

import io

from jinja2 import Environment, FileSystemLoader
from rich.console import Console
from rich.progress import Progress

from dispatcher.status.status import FleetStatus, JobStatus, price
from dispatcher.views.jobids import short_ids
from dispatcher.views.show import JobBar, bar, money, print_status, render_status
from dispatcher.views.web import HERE, _ago, _duration, _money, _utc


def test_short_ids_are_the_shortest_unique_prefixes_seven_hex_digits_at_least() -> None:
    ids = ["j-3f2a1b9c0d1e2f3a", "j-3f2a1b9d00000000", "j-8e7d6c5b4a392817", "night", "nightly-2"]
    short = short_ids(ids)
    assert short == {
        "j-3f2a1b9c0d1e2f3a": "j-3f2a1b9c",
        "j-3f2a1b9d00000000": "j-3f2a1b9d",
        "j-8e7d6c5b4a392817": "j-8e7d6c5",
        "night": "night",
        "nightly-2": "nightly-2",
    }
    for job, s in short.items():  # each names one job: itself when typed whole, else the only one it starts
        assert s == job or [j for j in ids if j.startswith(s)] == [job]


def test_costs_are_never_rounded_to_nothing() -> None:
    assert money(None) == "-" and money(0) == "0"
    assert money(0.0005) == "0.0005" and money(0.00123456) == "0.00123" and money(3e-6) == "3.00e-06"
    assert money(1.234) == "1.23" and money(12345.6, "$") == "$12,346"


def test_a_pool_without_a_price_leaves_the_cost_unknown_not_zero() -> None:
    job = JobStatus("j", 10, 4, 0, 6, 0, 1, 1, 0, True, gpu_seconds={"spot": 36.0, "spare": 10.0})
    price(job, {"spot": 1.0, "spare": 0.0})
    assert job.cost is None and job.cost_per_image is None
    price(job, {"spot": 1.0, "spare": 0.36})
    assert job.cost == 0.011 and job.cost_per_1000_images == 0.011 / 4 * 1000


def test_a_job_whose_render_time_redis_lost_has_an_unknown_cost_not_zero() -> None:
    # Taken back after a Redis loss with 4 images stored: 36 s counted since is not the whole job's.
    job = JobStatus("j", 10, 8, 0, 2, 0, 1, 1, 0, True, gpu_seconds={"spot": 36.0}, unaccounted=4)
    price(job, {"spot": 1.0})
    assert job.cost is None and job.cost_per_image is None and job.cost_per_1000_images is None
    # Images done, no render time counted at all: unknown too, never free.
    job = JobStatus("j", 10, 4, 0, 6, 0, 1, 1, 0, True)
    price(job, {"spot": 1.0})
    assert job.cost is None
    fleet = FleetStatus(jobs=[JobStatus("j", 10, 8, 0, 2, 0, 1, 1, 0, True, gpu_seconds={"spot": 36.0}, unaccounted=4)])
    out = io.StringIO()
    Console(file=out, width=200).print(render_status(fleet, Console(file=io.StringIO(), width=200)))
    row = next(line for line in out.getvalue().splitlines() if line.lstrip().startswith("j "))
    assert row.split()[-3:] == ["-", "-", "-"], row  # GPU s, cost, per 1k img


def test_a_job_all_quarantined_is_all_red_and_one_quarantined_prompt_still_shows() -> None:
    assert bar(0, 12, 12, plain=True).plain == "x" * 10
    assert bar(12, 0, 12, plain=True).plain == "#" * 10
    assert bar(9999, 1, 10000, plain=True).plain == "#" * 9 + "x"
    assert bar(0, 0, 12, plain=True).plain == "-" * 10
    spans = {span.style for span in bar(0, 12, 12).spans}
    assert spans == {"red"}
    progress = Progress(JobBar(10), console=Console(file=io.StringIO(), width=40, force_terminal=True))
    task = progress.add_task("job", total=12, done=0, quarantined=12)
    progress.update(task, completed=12)
    assert {span.style for span in JobBar(10).render(progress.tasks[task]).spans} == {"red"}


def test_the_jobs_table_fits_80_columns_and_never_cuts_an_id() -> None:
    jobs = [
        JobStatus(
            f"j-{i:016x}",
            1_000_000,
            999_999,
            1,
            0,
            0,
            1,
            0,
            0,
            True,
            eta_seconds=3600.0 * 99,
            images_per_minute=12345.6,
            gpu_seconds={"default": 1e6},
            cost=12345.0,
            cost_per_image=0.01234,
        )
        for i in range(3)
    ]
    fleet = FleetStatus(
        queues={"renderfleet.default.0123456789ab": 3},
        jobs=jobs,
        store="/x",
        workers=[
            {
                "worker": "default-host-1234-abcdef",
                "pool": "default",
                "model": "stabilityai/stable-diffusion-xl-base-1.0",
                "device": "cuda:0",
                "doing": f"{jobs[0].job}:7",
                "since": "1",
            }
        ],
    )
    out = io.StringIO()
    console = Console(file=out, width=80)
    console.print(render_status(fleet, console))
    text = out.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text and text.count("j-000000000") >= 3 and "default-host-1234-abcdef" in text
    assert "not shown at 80 columns" in text
    out = io.StringIO()
    print_status(fleet, Console(file=out, width=80), wide=True)  # every column, whole, however wide
    text = out.getvalue()
    assert "redelivered/lost" in text and "shards p/q/r" in text and "prio/share" in text
    assert "not shown" not in text and "…" not in text


def test_the_page_draws_rendered_green_and_quarantined_red() -> None:
    env = Environment(loader=FileSystemLoader(str(HERE / "templates")), autoescape=True)
    env.filters.update(money=_money, duration=_duration, ago=_ago, utc=_utc)
    row = env.get_template("_jobrow.html").render(j=JobStatus("j", 12, 0, 12, 0, 0, 3, 0, 0, True).to_dict())
    assert 'class="fill" data-percent="0.0"' in row and 'class="fill-q" data-percent="100.0"' in row
    assert '<td class="f-quarantined">12</td>' in row and '<td class="f-cpk">-</td>' in row


def _fleet(active: int, finished: int, folded: int = 0) -> FleetStatus:
    """A fleet of ``active`` running jobs, ``finished`` finished ones listed and ``folded`` counted, one worker."""
    jobs = [JobStatus(f"done-{i:03d}", 8, 8, 0, 0, 0, 2, 0, 0, True) for i in range(finished)]
    jobs += [JobStatus(f"live-{i:03d}", 8, 2, 0, 6, 0, 2, 2, 0, True) for i in range(active)]
    return FleetStatus(
        queues={"renderfleet.default.0123456789ab": 3},
        jobs=jobs,
        store="/x",
        folded=folded,
        workers=[{"worker": "default-host-1234-abcdef", "pool": "default", "model": "tiny", "device": "cpu"}],
    )


def _lines(fleet: FleetStatus, height: int | None = None) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=80, height=24)
    console.print(render_status(fleet, console, height=height))
    return out.getvalue().splitlines()


def test_finished_jobs_fold_into_one_line_that_says_how_to_list_them() -> None:
    lines = _lines(_fleet(active=3, finished=0, folded=994))
    assert [line.split()[0] for line in lines if line.startswith("live-")] == ["live-000", "live-001", "live-002"]
    assert "+994 finished: renderfleet status --all" in lines
    assert not any(line.startswith("done-") for line in lines) and len(lines) < 24
    assert any(line.startswith("workers") for line in lines) and any(line.startswith("queues") for line in lines)
    folded_only = _lines(_fleet(active=0, finished=0, folded=5))
    assert "+5 finished: renderfleet status --all" in folded_only and "no jobs" not in folded_only


def test_every_job_listed_shows_the_active_ones_first() -> None:
    lines = _lines(_fleet(active=2, finished=3))
    assert [line.split()[0] for line in lines if line.startswith(("live-", "done-"))] == [
        "live-000",
        "live-001",
        "done-000",
        "done-001",
        "done-002",
    ]
    assert not any("renderfleet status --all" in line for line in lines)


def test_the_watch_at_80_by_24_with_12_jobs_keeps_the_queues_and_workers_on_the_screen() -> None:
    lines = _lines(_fleet(active=12, finished=0, folded=40), height=23)
    assert len(lines) <= 23, "\n".join(lines)
    assert any(line.startswith("workers") for line in lines) and "default-host-1234-abcdef" in "\n".join(lines)
    assert any(line.startswith("queues") for line in lines)
    shown = sum(line.startswith("live-") for line in lines)
    assert 0 < shown < 12 and f"+{12 - shown} more active, +40 finished: renderfleet status --all" in lines
    # a terminal tall enough lists them all
    assert sum(line.startswith("live-") for line in _lines(_fleet(active=12, finished=0), height=60)) == 12


def test_a_job_whose_every_prompt_is_quarantined_or_that_failed_is_failed_never_done() -> None:
    quarantined = JobStatus("j-all-quarantined", 200, 0, 200, 0, 0, 4, 0, 0, True, eta_seconds=0.0)
    failed = JobStatus(
        "j-model-failed", 200, 0, 0, 0, 0, 4, 0, 0, True, cancelled=1.0, failure="model 'x' could not be loaded"
    )
    fine = JobStatus("j-rendered", 200, 199, 1, 0, 0, 4, 0, 0, True)
    assert [j.state for j in (quarantined, failed, fine)] == ["failed", "failed", "finished"]
    assert quarantined.to_dict()["failure"].startswith("every prompt (200) was quarantined")
    assert failed.to_dict()["failure"] == "model 'x' could not be loaded" and fine.to_dict()["failure"] is None
    out = io.StringIO()
    jobs = [quarantined, failed, fine]
    print_status(FleetStatus(jobs=jobs), Console(file=out, width=200), wide=True, ids={j.job: j.job for j in jobs})
    text = out.getvalue()
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip().startswith("j-")}
    assert "failed" in rows["j-all-quarantined"] and "done" not in rows["j-all-quarantined"]
    assert "failed" in rows["j-model-failed"] and "cancelled" not in rows["j-model-failed"]
    assert "done" in rows["j-rendered"]
    assert text.count("could not be loaded") == 1 and text.count("every prompt (200) was quarantined") == 1


def test_status_shows_each_pool_in_nodes_and_gpus_where_a_node_has_several() -> None:
    fleet = _fleet(active=1, finished=0)
    node = [{"worker": f"quad-h-gpu{g}-1", "pool": "quad", "node": "h-77", "model": "tiny"} for g in range(4)]
    fleet.workers += node
    fleet.desired, fleet.gpus_per_node = {"quad": 8, "default": 1}, {"quad": 4, "default": 1}
    (line,) = [line for line in _lines(fleet) if line.startswith("pools:")]
    assert line == "pools: default 1 up / 1 wanted, quad 1 node, 4 GPUs up / 2 nodes, 8 GPUs wanted"
    assert fleet.to_dict()["pool_nodes"]["quad"] == {
        "gpus_per_node": 4,
        "nodes": 1,
        "gpus": 4,
        "desired_nodes": 2,
        "desired_gpus": 8,
    }
    # Nothing decided, nothing published: a supervisor's workers still show as one node.
    fleet.desired, fleet.gpus_per_node = {}, {}
    assert [line for line in _lines(fleet) if line.startswith("pools:")] == ["pools: quad 1 node, 4 GPUs up"]
