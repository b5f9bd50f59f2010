"""Cards: a job's --min-vram checked and held against each card; the live fleet's figures by card."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dispatcher.jobs.submit import SubmitOptions, check_options, job_id
from dispatcher.status.status import FleetStatus
from renderfleet import cards
from renderfleet.errors import InputError
from renderfleet.spec import JobSpec, RenderParams

PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 5000, "40", True])
def test_min_vram_must_be_a_card_size_in_gb_and_the_flag_is_named(value: object) -> None:
    why = cards.min_vram_problem(value)
    assert why is not None and why.startswith("--min-vram: "), why
    if value != 0:  # 0 is "any card" in the options: not a problem there
        with pytest.raises(InputError, match="--min-vram: "):
            check_options(SubmitOptions(params=PARAMS, min_vram=value))  # type: ignore[arg-type]
    assert cards.min_vram_problem(40) is None and cards.min_vram_problem(22.5) is None
    check_options(SubmitOptions(params=PARAMS, min_vram=40))


def test_a_card_qualifies_by_its_size_as_sold_and_one_of_unknown_memory_never_does() -> None:
    # An H100 80GB reports 79.6 GiB, an L4 24GB 22.5, an A100 40GB 39.4: each qualifies for its own size.
    assert cards.qualifies(79.6, 80) and cards.qualifies(22.5, 24) and cards.qualifies(39.4, 40)
    assert not cards.qualifies(39.4, 48) and not cards.qualifies(22.5, 40) and not cards.qualifies(15.0, 24)
    assert not cards.qualifies(None, 16)  # a CPU or bench model with no card: never for a job that asks for one
    assert cards.qualifies(None, 0) and cards.qualifies(8.0, 0)  # no minimum: any worker
    # keys.job's value as Redis holds it; anything unreadable is no minimum, never a refusal of every card.
    assert cards.read_min_vram(b"40") == 40 and cards.read_min_vram(None) == 0 and cards.read_min_vram(b"x") == 0
    assert cards.vram_of({"vram_gib": 79.6}) == 79.6 and cards.vram_of({"vram_gib": "80"}) is None
    assert "16 GB or more; this one (NVIDIA T4) has 14.6 GiB" in cards.refusal("NVIDIA T4", 14.6, 16)


def test_min_vram_is_where_a_job_renders_not_what_so_not_its_id_and_workers_read_it_from_its_hash() -> None:
    assert job_id("d", PARAMS, "file:///s") == job_id("d", PARAMS, "file:///s")  # the id takes no min_vram at all
    spec = JobSpec(job="j-1", params=PARAMS, total=3, shard_size=2, batch_size=1, min_vram=40)
    stored = json.loads(spec.to_json())
    assert stored["min_vram"] == 40 and JobSpec.from_json(spec.to_json()) == spec  # kept in the store's spec
    assert "min_vram" not in json.loads(spec.registration())  # a worker from before cards still reads it
    assert "min_vram" not in json.loads(JobSpec(job="j-1", params=PARAMS, total=3, shard_size=2, batch_size=1).to_json())


def _worker(card: str, pool: str, images: int, render_ms: int, vram: float | None = None) -> dict[str, object]:
    info: dict[str, object] = {"worker": f"w-{card}-{pool}", "card": card, "pool": pool}
    if vram is not None:
        info["vram_gib"] = vram
    return {**info, "images": str(images), "render_ms": str(render_ms)}  # counters as status reads them: text


def test_card_rows_give_images_per_minute_per_worker_and_cost_per_image_cheapest_first() -> None:
    workers = [
        _worker("NVIDIA L4", "spot-l4", 300, 600_000, 22.5),  # 300 images in 600 s: 30 a minute
        _worker("NVIDIA L4", "spot-l4", 100, 200_000, 22.5),
        _worker("NVIDIA H100 80GB HBM3", "spot-h100", 1_200, 480_000, 79.6),  # 150 a minute
        _worker("NVIDIA A10G", "unpriced", 50, 100_000),
        _worker("NVIDIA T4", "spot-l4", 0, 0),  # up, nothing rendered yet
    ]
    rows = cards.card_rows(workers, {"spot-l4": 0.9, "spot-h100": 3.6})
    assert [r.card for r in rows] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4", "NVIDIA A10G", "NVIDIA T4"]
    h100, l4, a10, t4 = rows
    assert h100.images_per_minute == pytest.approx(150) and h100.cost_per_image == pytest.approx(3.6 * 480 / 3600 / 1200)
    assert l4.workers == 2 and l4.images == 400 and l4.images_per_minute == pytest.approx(30)
    assert l4.cost_per_image == pytest.approx(0.9 * 800 / 3600 / 400) and l4.vram_gib == 22.5
    assert a10.cost_per_image is None and a10.images_per_minute == pytest.approx(30)  # no price: no cost
    assert t4.images_per_minute is None and t4.cost_per_image is None and t4.vram_gib is None
    assert h100.to_dict()["pools"] == ["spot-h100"] and json.dumps([r.to_dict() for r in rows])
    # A malformed counter counts as nothing, and a worker with no card is "unknown".
    (odd,) = cards.card_rows([{"pool": "p", "images": "x", "render_ms": "-5"}], {})
    assert odd.card == "unknown" and odd.images == 0 and odd.images_per_minute is None


def test_the_autoscaler_takes_a_pools_speed_from_its_cards_record_for_the_backlogs_kind_of_image(tmp_path: Path) -> None:
    """Policy rule 9's inputs: the pool's card (its config's, else its workers'), and the speed measured there
    for the backlog's model and size, read from the store (a folder store here) once a minute at most."""
    from dispatcher.fleet.autoscale import Autoscaler, BacklogKind, pool_card
    from dispatcher.fleet.policy import CARD, PoolState
    from renderfleet import speeds
    from renderfleet.settings import PoolConfig, Settings
    from renderfleet.store import LocalStore

    store = LocalStore(tmp_path / "store")
    spec = JobSpec(
        job="j-1", params=RenderParams(model="m", steps=4, width=512, height=512), total=9, shard_size=3, batch_size=4
    )
    kind = BacklogKind(spec, work_seconds_per_image=0.15)
    speeds.add(store, kind.wanted("NVIDIA L4").key, 100, 200.0, source="bench")  # 2 s an image on the L4
    speeds.add(store, replace(kind.wanted("NVIDIA L4").key, width=1024), 100, 800.0, source="bench")  # another size
    now = [0.0]
    scaler = Autoscaler(Settings(), None, store, {}, clock=lambda: now[0])  # type: ignore[arg-type]
    workers = [
        {"pool": "spot-a", "card": "NVIDIA L4"},
        {"pool": "spot-a", "card": "NVIDIA L4"},
        {"pool": "spot-b", "card": "x"},
    ]
    assert pool_card(PoolConfig(card="NVIDIA H100 80GB HBM3"), workers, "spot-a") == "NVIDIA H100 80GB HBM3"
    assert pool_card(PoolConfig(), workers, "spot-a") == "NVIDIA L4" and pool_card(PoolConfig(), workers, "none") == ""

    fleet = FleetStatus(workers=workers)
    a = scaler._card_speed(PoolState("spot-a", PoolConfig(kind="spot"), 0, 0), kind, fleet)
    assert (a.measured, a.card, a.seconds_per_image) == (CARD, "NVIDIA L4", 2.0)
    assert a.speed == pytest.approx(0.15 / 2.0) and a.routed_for == "m 512x512, 4 steps, batch 4"
    # A card with nothing measured for this kind of image keeps what its counters said (here: nothing).
    b = scaler._card_speed(PoolState("b", PoolConfig(kind="spot", card="NVIDIA T4"), 0, 0), kind, fleet)
    assert (b.measured, b.card, b.seconds_per_image, b.speed) == ("", "NVIDIA T4", None, 1.0)
    # Read once a minute: a record written since is used only once the minute is over.
    speeds.add(store, kind.wanted("NVIDIA T4").key, 100, 300.0, source="bench")
    assert (
        scaler._card_speed(PoolState("spot-b", PoolConfig(kind="spot", card="NVIDIA T4"), 0, 0), kind, fleet).measured == ""
    )
    now[0] = 61.0
    t4 = scaler._card_speed(PoolState("spot-b", PoolConfig(kind="spot", card="NVIDIA T4"), 0, 0), kind, fleet)
    assert (t4.measured, t4.seconds_per_image) == (CARD, 3.0)


def test_a_worker_names_its_cards_memory_and_only_a_bench_model_takes_a_stand_in_card() -> None:
    from worker.accounting.speeds import BENCH_DEVICE, bench_card_name, vram_for

    assert vram_for("cpu") is None and vram_for(BENCH_DEVICE) is None  # no card: no memory to name
    assert vram_for(BENCH_DEVICE, "big:80") == 80 and bench_card_name(BENCH_DEVICE, "big:80") == "big (bench model)"
    assert vram_for("cpu", "big:80") is None and vram_for("xpu:0", "big:80") is None  # a real device reports its own
    assert bench_card_name(BENCH_DEVICE) == BENCH_DEVICE


def test_the_python_api_takes_min_vram_and_checks_it_as_the_flag() -> None:
    from renderfleet.api import Client
    from renderfleet.settings import Settings

    client = Client(Settings())
    assert client.options(model="tiny", min_vram=40).min_vram == 40
    assert client.options(model="tiny").min_vram == 0
    with pytest.raises(InputError, match="--min-vram: a card's memory in GB"):
        client.options(model="tiny", min_vram=-1)


def test_a_pools_card_memory_is_its_configs_else_the_smallest_its_live_workers_report_else_unknown() -> None:
    assert cards.pool_vram(79.6, [{"vram_gib": 22.5}]) == 79.6
    assert cards.pool_vram(None, [{"vram_gib": 79.6}, {"vram_gib": 39.4}]) == 39.4
    # One worker that names none (a CPU, an older worker): the pool's next may be that one.
    assert cards.pool_vram(None, [{"vram_gib": 79.6}, {}]) is None
    assert cards.pool_vram(None, []) is None
