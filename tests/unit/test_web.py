"""The web page's pieces without a server: charts, the gallery's pages, checked names, thumbnails."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from dispatcher.status import FleetStatus, JobStatus
from dispatcher.web import (
    PAGE_SIZE,
    NotHere,
    checked_image,
    checked_job,
    gallery_page,
    image_meta,
    samples,
    svg_chart,
    thumb_key,
    thumbnail,
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
    thumb = thumbnail(store, "j-1", name)
    assert store.get(thumb_key("j-1", name)) == thumb and thumb_key("j-1", name).startswith("jobs/j-1/thumbs/")
    with Image.open(io.BytesIO(thumb)) as im:
        assert im.format == "WEBP" and max(im.size) <= 192
    meta = image_meta(store, "j-1", name)
    assert meta["prompt"] == "a <b>fox</b> 3" and meta["seed"] == "3" and meta["size"] == "64x32"
    store.put(thumb_key("j-1", name), b"kept")
    assert thumbnail(store, "j-1", name) == b"kept"  # never made again


def test_charts_are_inline_svg_with_text_escaped() -> None:
    svg = str(svg_chart("<script>x</script>", {"a": [(90.0, 1.0), (100.0, 3.0)], "b": []}, now=100.0))
    assert svg.startswith("<svg") and "<script>" not in svg and "&lt;script&gt;" in svg and "<polyline" in svg
    assert "no samples yet" in str(svg_chart("empty", {"a": []}, now=100.0))


def test_samples_are_bounded_one_per_pool() -> None:
    job = JobStatus("j", 10, 4, 1, 3, 2, 3, 1, 1, True)
    fleet = FleetStatus(queues={"q": 2}, workers=[{"pool": "spot"}, {"pool": "spot"}], jobs=[job],
                        backlog_seconds=7.5, desired={"spot": 3})
    assert samples(fleet) == {"queue_shards": 2.0, "backlog_images": 5.0, "backlog_seconds": 7.5,
                              "workers.spot": 2.0, "desired.spot": 3.0}
    json.dumps(samples(fleet))
