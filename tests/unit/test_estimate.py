"""``submit --estimate``'s arithmetic (dispatcher/views/estimate.py): the job split between pools by their
images per second, wall time at current and maximum sizes, costs, the pools that would serve it, the
prompts counted by kind of image, and nothing written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dispatcher.jobs.submit import SubmitOptions
from dispatcher.views.estimate import (
    BudgetCase,
    Group,
    PoolView,
    budget_view,
    estimate_file,
    overshoot_note,
    pools_for,
    project,
    read_prompts,
    text,
)
from renderfleet import families, spec, speeds
from renderfleet.settings import PoolConfig, Settings
from renderfleet.spec import RenderParams
from renderfleet.stages import Stage
from renderfleet.store import LocalStore

ONE = [Group(1024, 1024, 30, (), 1000)]


def flat(seconds: dict[str, float], basis: str = speeds.MEASURED):
    """A speed per pool, whatever the image."""
    return lambda pool, group: speeds.Speed(seconds[pool.name], basis, 10)


def view(name: str, price: float, now: int, most: int, card: str = "c") -> PoolView:
    return PoolView(name, price, now, most, card, "workers", configured=True)


def test_the_job_is_split_by_images_per_second_and_costs_are_each_pools() -> None:
    # baseline: 2 workers at 2 s an image (1 image/s); spot: 1 worker at 1 s (1 image/s) now, 3 at most
    pools = [view("baseline", 3.6, 2, 2), view("spot", 1.8, 1, 3)]
    rows, now, at_max = project(1000, 100, ONE, pools, flat({"baseline": 2.0, "spot": 1.0}))
    base, spot = rows
    assert base.seconds_per_image == 2.0 and base.gpu_seconds_alone == 2000 and base.cost_alone == pytest.approx(2.0)
    assert base.cost_per_image == pytest.approx(0.002) and spot.cost_per_image == pytest.approx(0.0005)
    # now: half the prompts each, 1000 s of the baseline's GPUs and 500 of spot's, done in 500 s
    assert base.now is not None and spot.now is not None
    assert (base.now.images, base.now.gpu_seconds, spot.now.images) == (500, 1000, 500)
    assert (now.workers, now.gpu_seconds, now.wall_seconds) == (3, 1500, 500)
    assert now.cost == pytest.approx(1.0 + 0.25)
    # at most: spot renders 3 of every 4 prompts, done in 250 s
    assert spot.at_max is not None and spot.at_max.images == 750
    assert (at_max.workers, at_max.gpu_seconds, at_max.wall_seconds) == (5, 1250, 250)
    assert at_max.cost == pytest.approx(0.5 + 750 / 3600 * 1.8)


def test_a_job_of_few_shards_uses_no_more_workers_than_it_has_shards() -> None:
    _, now, at_max = project(1000, 2, ONE, [view("spot", 1.0, 1, 8)], flat({"spot": 1.0}))
    assert (now.workers, now.wall_seconds) == (1, 1000)
    assert (at_max.workers, at_max.wall_seconds, at_max.gpu_seconds) == (2, 500, 1000)


def test_an_unpriced_pool_with_a_share_leaves_the_total_without_a_cost_and_no_worker_no_wall_time() -> None:
    rows, now, at_max = project(1000, 10, ONE, [view("a", 3.6, 0, 1), view("b", 0.0, 0, 1)], flat({"a": 1.0, "b": 1.0}))
    assert (now.gpu_seconds, now.wall_seconds, now.cost) == (None, None, None)
    assert rows[0].now is None and rows[1].cost_alone is None and rows[1].price_per_hour is None
    assert at_max.gpu_seconds == 1000 and at_max.cost is None
    assert rows[0].at_max is not None and rows[0].at_max.cost == pytest.approx(0.5)


def test_a_pools_figure_is_over_the_jobs_kinds_of_image_and_as_weak_as_its_weakest() -> None:
    groups = [Group(512, 512, 30, (), 300), Group(1024, 1024, 30, (), 100)]

    def speed(pool: PoolView, group: Group) -> speeds.Speed:
        small = group.width == 512
        return speeds.Speed(1.0 if small else 4.0, speeds.MEASURED if small else speeds.ASSUMED, 5 if small else 0)

    [row], _, _ = project(400, 10, groups, [view("p", 1.0, 1, 1)], speed)
    assert row.seconds_per_image == pytest.approx((300 + 400) / 400) and row.basis == speeds.ASSUMED
    assert [s["prompts"] for s in row.speeds] == [300, 100]


def test_the_pools_of_a_job_their_prices_cards_and_sizes() -> None:
    settings = Settings(
        pools={
            "baseline": PoolConfig(price_per_hour=2.5, min=1, max=4, card="NVIDIA L4"),
            "spot": PoolConfig(kind="spot", max=8),
        }
    )
    live = {"baseline": ["NVIDIA A10G"], "spot": ["NVIDIA H100", "NVIDIA H100", ""], "extra": ["X"]}
    got = {p.name: p for p in pools_for(settings, "default", live, {"spot": 0.9, "baseline": 9.0, "extra": 1.0})}
    assert got["baseline"] == PoolView("baseline", 2.5, 1, 4, "NVIDIA L4", "config", configured=True)
    assert got["spot"] == PoolView("spot", 0.9, 3, 8, "NVIDIA H100", "workers", configured=True)
    assert got["extra"] == PoolView("extra", 1.0, 1, 1, "X", "workers", configured=False)
    # a job for the spot pool: spot alone (and what live workers serve its queue with)
    assert [p.name for p in pools_for(settings, "spot", {}, {})] == ["spot"]


def test_prompts_are_counted_by_size_steps_and_the_stages_they_run(tmp_path: Path) -> None:
    up, refine = Stage("upscale", factor=2), Stage("refine")
    params = RenderParams(model="tiny", steps=30, width=512, height=512, stages=(up, refine))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "steps": 20}\n{"prompt": "c", "skip_stages": "2"}\n{"prompt": "d"}\n')
    summary, groups = read_prompts(str(path), params)
    assert summary.total == 4
    assert sorted((g.steps, g.stages, g.count) for g in groups) == [
        (20, (up, refine), 1),
        (30, (up,), 1),
        (30, (up, refine), 2),
    ]
    txt = tmp_path / "p.txt"
    txt.write_text("a\nb\n")
    assert read_prompts(str(txt), params)[1] == [Group(512, 512, 30, (up, refine), 2)]


def test_an_estimate_without_redis_writes_nothing_and_says_what_it_assumed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(10)))
    opts = SubmitOptions(RenderParams(model="tiny", steps=30, width=512, height=512), shard_size=4)
    settings = Settings(pools={"spot": PoolConfig(kind="spot", price_per_hour=3.6, max=2)})
    est = estimate_file(str(path), opts, settings=settings, store=store, client=None, family=families.SD)
    assert not (tmp_path / "store").exists()
    assert (est.prompts, est.shards, est.by_basis(speeds.ASSUMED)) == (10, 3, ["spot"])
    [spot] = est.pools
    assert spot.seconds_per_image == pytest.approx(0.15 * 0.262144 * 30)
    assert est.now.gpu_seconds is None and est.at_max.wall_seconds == pytest.approx(10 * spot.seconds_per_image / 2)
    out = text(est)
    assert "at current sizes: no worker is up" in out and "assumed: spot: " in out and "no Redis to read" in out
    data = est.to_dict()
    assert data["submitted"] is False and data["assumed"] == ["spot"] and data["pools"][0]["cost_per_image"] > 0
    assert data["job"].startswith("j-") and spec.job_id_problem(data["job"]) is None


def test_a_well_known_hub_id_is_priced_at_its_familys_rate_offline_and_the_first_lines_say_so(tmp_path: Path) -> None:
    # Offline, an SDXL id was priced at SD 1.x's rate: a 200,000-image estimate 2.3x too cheap (issue 46).
    sdxl = "stabilityai/stable-diffusion-xl-base-1.0"
    assert families.family_here(sdxl) is families.SDXL and families.family_here(sdxl.upper()) is families.SDXL
    assert families.family_here("black-forest-labs/FLUX.1-schnell") is families.FLUX_SCHNELL
    assert families.family_here("someone/some-model") is None  # the hub tells, where it answers
    store = LocalStore(tmp_path / "store")
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(10)))
    settings = Settings(pools={"spot": PoolConfig(kind="spot", price_per_hour=3.6, max=2)})
    rates = {}
    for model in (sdxl, "runwayml/stable-diffusion-v1-5"):
        opts = SubmitOptions(RenderParams(model=model, steps=30, width=1024, height=1024), shard_size=4)
        est = estimate_file(str(path), opts, settings=settings, store=store, client=None, family=families.family_here(model))
        rates[model] = est.pools[0].seconds_per_image
        first = text(est).splitlines()[:2]
        assert first[0].startswith(f"estimate for 10 prompts of {model} at 1024x1024")
        title = families.family_here(model).title  # type: ignore[union-attr]
        assert first[1] == f"as {title}: spot {rates[model]:.4g} s/image, assumed", first
    assert rates[sdxl] == pytest.approx(
        rates["runwayml/stable-diffusion-v1-5"] * families.SDXL.seconds_per_mpstep / families.SD.seconds_per_mpstep
    )
    assert rates[sdxl] > 2 * rates["runwayml/stable-diffusion-v1-5"]


def test_pools_whose_card_cannot_take_the_jobs_min_vram_are_left_out_and_the_notes_say_so(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(10)))
    settings = Settings(
        pools={
            "big": PoolConfig(kind="spot", price_per_hour=3.0, max=2, card="NVIDIA H100 80GB HBM3", vram_gib=79.6),
            "small": PoolConfig(kind="spot", price_per_hour=0.8, max=4, card="NVIDIA L4", vram_gib=22.5),
            "anycard": PoolConfig(kind="spot", price_per_hour=0.5, max=4),
        }
    )
    params = RenderParams(model="tiny", steps=30, width=512, height=512)

    def estimate(min_vram: float):
        opts = SubmitOptions(params, shard_size=4, min_vram=min_vram)
        return estimate_file(str(path), opts, settings=settings, store=store, client=None, family=families.SD)

    assert [p.pool for p in estimate(0).pools] == ["big", "small", "anycard"]
    est = estimate(40)
    assert [p.pool for p in est.pools] == ["big"]
    assert "pool small: left out, its card (NVIDIA L4, 22.5 GiB) is below --min-vram 40" in est.notes
    assert (
        "pool anycard: left out, its card (unknown, memory unknown) is below --min-vram 40; give it vram_gib in the config"
        in est.notes
    )
    assert est.at_max.workers == 2 and "note: pool small: left out" in text(est)
    none = estimate(96)
    assert none.pools == [] and none.at_max.wall_seconds is None
    assert "no pool here has a card of >= 96 GB: nothing would render the job" in none.notes
    assert "nothing would render the job" in text(none)
    # A pool without vram_gib in the config takes its live workers' word: the smallest (renderfleet/cards.py).
    live = {"anycard": ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"]}
    [*_, anycard] = pools_for(settings, "default", live, {}, {"anycard": 39.4})
    assert anycard.vram_gib == 39.4 and anycard.card == "NVIDIA A100-SXM4-80GB"


def test_a_budget_is_set_against_each_scenario_with_where_it_stops_and_the_most_it_is_exceeded_by() -> None:
    # As test_the_job_is_split...: now 1.25 for the job (2 + 1 workers), at most 0.5 + 0.375 (2 + 3 workers)
    pools = [view("baseline", 3.6, 2, 2), view("spot", 1.8, 1, 3)]
    rows, _, _ = project(1000, 100, ONE, pools, flat({"baseline": 2.0, "spot": 1.0}))
    b = budget_view(1.0, rows, 1000, 4, None)
    assert b.batch_cost == pytest.approx({"baseline": 0.008, "spot": 0.002})  # 4 images at 0.002 and 0.0005
    assert b.now is not None and b.at_max is not None
    assert (b.now.covers, b.now.cost) == (False, pytest.approx(1.25))
    assert b.now.images == int(1000 * (1.0 - 0.008) / 1.25)  # the fence stops it once its spend and a batch reach it
    assert b.now.over_by == pytest.approx(2 * 0.008 + 0.002)  # a batch per worker rendering it
    assert (b.at_max.covers, b.at_max.images, b.at_max.over_by) == (True, 1000, pytest.approx(2 * 0.008 + 3 * 0.002))
    # A pool with no price counts at the dearest, as the budget counts it.
    rows, _, _ = project(1000, 100, ONE, [view("a", 3.6, 1, 1), view("b", 0.0, 1, 1)], flat({"a": 1.0, "b": 1.0}))
    assert budget_view(10, rows, 1000, 4, None).now == BudgetCase(pytest.approx(1.0), True, 1000, pytest.approx(0.008))


def test_an_estimate_with_a_budget_says_whether_it_covers_the_job_and_without_prices_how_to_add_them(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(100)))
    params = RenderParams(model="tiny", steps=30, width=512, height=512)
    settings = Settings(pools={"spot": PoolConfig(kind="spot", price_per_hour=3.6, max=2)})
    opts = SubmitOptions(params, shard_size=4, batch_size=4, pool="spot", budget=0.05)
    est = estimate_file(str(path), opts, settings=settings, store=store, client=None, family=families.SD)
    per_image = 0.15 * 0.262144 * 30 * 3.6 / 3600  # the family's assumed rate at 3.6/h
    assert est.budget is not None and est.budget.now is None and est.budget.at_max is not None
    assert est.budget.at_max.images == int(100 * (0.05 - 4 * per_image) / (100 * per_image)) == 38
    out = text(est)
    assert "budget 0.05: at maximum sizes it stops after about 38 of 100 images (the job costs 0.118)" in out
    assert f"budget 0.05: exceeded by at most one batch per worker: {8 * per_image:.4g} at maximum sizes (2 workers)" in out
    data = est.to_dict()["budget"]
    assert data["budget"] == 0.05 and data["at_max"]["covers"] is False and data["problem"] is None
    covered = text(estimate_file(str(path), replace(opts, budget=1), settings=settings, store=store, client=None))
    assert "budget 1: at maximum sizes it covers the job (cost 0.118, 0.882 to spare)" in covered

    unpriced = Settings(pools={"spot": PoolConfig(kind="spot", max=2)})
    est = estimate_file(str(path), opts, settings=unpriced, store=store, client=None, family=families.SD)
    assert est.budget is not None and est.to_dict()["budget"]["problem"].startswith(
        "--budget 0.05: pool 'spot' has no price"
    )
    assert "budget 0.05: not counted, and a submit refuses it: pool 'spot' has no price per hour" in text(est)
    assert "set price_per_hour in [pools.spot] of the config (--config FILE)" in text(est)
    assert estimate_file(str(path), replace(opts, budget=None), settings=settings, store=store, client=None).budget is None


def test_submit_with_a_budget_says_the_most_it_can_be_exceeded_by_in_money(tmp_path: Path) -> None:
    params = RenderParams(model="tiny", steps=30, width=512, height=512)
    settings = Settings(pools={"spot": PoolConfig(kind="spot", price_per_hour=3.6, max=2)})
    opts = SubmitOptions(params, batch_size=4, pool="spot", budget=25)
    note = overshoot_note(opts, settings=settings, store=LocalStore(tmp_path / "store"), client=None, family=families.SD)
    batch = 4 * 0.15 * 0.262144 * 30 * 3.6 / 3600
    assert note == (
        "budget 25: the job stops once its spend and a batch reach it; it can go past it by at most one batch per "
        f"worker: 0 with the 0 workers up now, {2 * batch:.4g} at its pools' maximum of 2 workers "
        f"(a batch of 4: spot {batch:.4g}; --estimate says what the speeds rest on)"
    )
