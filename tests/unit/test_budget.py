"""Budgets, without a fleet: a job's spend and its projection, its state, the checks of a budget and of a
pool's monthly cap in the config, and policy rule 8 (a pool at its monthly budget goes to 0)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from dispatcher.fleet.policy import PoolState, decide
from dispatcher.status.status import FleetStatus, JobStatus, price
from dispatcher.views.show import render_status
from renderfleet import spec
from renderfleet.budget import (
    Record,
    Spent,
    budget_problem,
    ceil_money,
    go_on,
    least_budget,
    load,
    pinned,
    projected,
    read_prices,
    record_due,
    save,
    spend,
    unpriced_problem,
)
from renderfleet.errors import ConfigError
from renderfleet.settings import AutoscaleConfig, PoolConfig, load_settings
from renderfleet.store import open_store

CFG = AutoscaleConfig(drain_seconds=600, cooldown_seconds=120, cold_start_seconds=60, scale_in_margin=0.7)
BASE = PoolState("baseline", PoolConfig(kind="on-demand", price_per_hour=2.0, min=1, max=4), current=1, ready=1)
SPOT = PoolState("spot", PoolConfig(kind="spot", price_per_hour=0.8, min=0, max=8, monthly_budget=500), current=3, ready=3)
NOW = 10_000.0


def test_a_budget_is_a_positive_amount_of_money() -> None:
    assert budget_problem(12.5) is None and budget_problem(1) is None
    for bad in (0, -3, float("inf"), float("nan"), "5", True):
        assert budget_problem(bad) is not None, bad
    why = unpriced_problem(10, "spare", {"default": 3.6})
    assert why is not None and why.startswith("--budget 10: pool 'spare' has no price per hour")
    assert unpriced_problem(10, "default", {"default": 3.6}) is None


def test_a_jobs_spend_is_its_gpu_time_by_pool_at_each_pools_price() -> None:
    stats = {"render_ms.default": 7_200_000, "render_ms.spot": 3_600_000, "images.default": 40, "wasted_images": 3}
    assert spend(stats, {"default": 3.6, "spot": 0.9}) == pytest.approx(2 * 3.6 + 0.9)
    # A pool with no price counts at the dearest: a budget binds early, never late (renderfleet/lua/fence.lua too).
    assert spend(stats, {"default": 3.6}) == pytest.approx(3 * 3.6)
    # What a killed holder lost counts as well (the reaper's killed_ms), and nothing else does.
    killed = {**stats, "killed_ms.spot": 1_800_000, "kept_ms.default": 9_999_999, "lost_ms.spot": 9_999_999}
    assert spend(killed, {"default": 3.6, "spot": 0.9}) == pytest.approx(2 * 3.6 + 1.5 * 0.9)


def test_a_budget_needs_a_price_on_its_pool_and_on_each_stage_pool_and_pins_them() -> None:
    assert unpriced_problem(1, ["gen", "big"], {"gen": 2.0, "big": 4.0}) is None
    why = unpriced_problem(1, ["gen", "big"], {"gen": 2.0})
    assert why is not None and why.startswith("--budget 1: pool 'big' has no price per hour")
    assert pinned({"gen": 2.0, "free": 0.0, "bad": float("nan")}) == {"gen": 2.0}
    assert read_prices('{"gen": 2.0, "big": 4}') == {"big": 4.0, "gen": 2.0}
    for bad in (None, "", b"", "[]", '{"gen": "x"}', '{"gen": -1}', "[" * 5000, '{"gen": 1e999}', "not json"):
        assert read_prices(bad) is None, bad


def test_a_budgeted_jobs_cost_is_counted_at_its_pinned_prices_even_where_status_has_none() -> None:
    job = JobStatus("j", 40, 10, 0, 30, 0, 5, 4, 0, True, gpu_seconds={"default": 3600.0, "free": 1800.0})
    job.budget, job.budget_prices, job.killed_by_pool = 5.0, {"default": 2.0}, {"default": 900.0}
    job.unaccounted = 3  # a job Redis took back: still counted, its carried spend beside it
    price(job, {})
    assert job.cost == pytest.approx(2.0 + 1.0 + 0.5) and job.cost_per_image == pytest.approx(0.35)


def test_the_projection_is_the_spend_per_image_times_every_image() -> None:
    assert projected(0.5, 10, 40) == pytest.approx(2.0)
    assert projected(None, 10, 40) is None and projected(0.0, 0, 40) is None
    job = JobStatus("j", 40, 10, 0, 30, 0, 5, 4, 0, True, gpu_seconds={"default": 500.0})
    price(job, {"default": 3.6})
    assert job.cost == pytest.approx(0.5) and job.projected_cost == pytest.approx(2.0)


def test_a_job_stopped_at_its_budget_shows_budget_with_its_spend_and_projection() -> None:
    job = JobStatus("j-0123456789abcdef", 40, 10, 0, 30, 0, 5, 4, 0, True, gpu_seconds={"default": 500.0})
    job.budget, job.budget_reached, job.budget_spent, job.cancelled = 0.5, 1_800_000_000.0, 0.49, 1_800_000_000.0
    price(job, {"default": 3.6})
    assert job.state == "budget" and job.to_render == 0 and job.to_dict()["state"] == "budget"
    job.done = 40  # finished wins: its last batch brought it to the budget
    assert job.state == "finished"
    job.done = 10
    console = Console(width=200, record=True, color_system=None)
    console.print(render_status(FleetStatus(jobs=[job], prices={"default": 3.6}), console))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "10/40" in line)
    assert " budget " in f" {row} "
    assert "budget 0.5, spent 0.5 (100%), projected 2.00 at its rate; stopped at its budget" in text


def test_a_monthly_budget_is_checked_with_the_key_and_the_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RENDERFLEET_CONFIG", raising=False)
    path = tmp_path / "fleet.toml"
    path.write_text("[pools.spot]\nprice_per_hour = 0.9\nmonthly_budget = 250\n")
    assert load_settings(config=str(path)).pools["spot"].monthly_budget == 250
    for text, needle in (
        ("[pools.spot]\nprice_per_hour = 0.9\nmonthly_budget = -5\n", "fleet.toml: pools.spot.monthly_budget = -5: "),
        ("[pools.spot]\nprice_per_hour = 0.9\nmonthly_budget = inf\n", "fleet.toml: pools.spot.monthly_budget = inf: "),
        ("[pools.spot]\nmonthly_budget = 100\n", "fleet.toml: pools.spot: monthly_budget = 100 needs a price_per_hour"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_settings(config=str(path))
        assert needle in str(err.value).replace(str(tmp_path) + "/", ""), err.value


def test_rule_8_a_pool_at_its_monthly_budget_goes_to_zero_and_the_backlog_to_the_others() -> None:
    under = {d.pool: d for d in decide(3_000, [BASE, replace(SPOT, month_spend=499.0)], CFG, NOW)}
    assert under["spot"].desired == 4 and "monthly" not in under["spot"].reason
    out = {d.pool: d for d in decide(3_000, [BASE, replace(SPOT, month_spend=500.0)], CFG, NOW)}
    assert out["spot"].desired == 0
    assert out["spot"].reason.startswith("monthly budget reached: 500.00 of 500 spent this month")
    assert out["baseline"].desired == 4  # what spot cannot take, the baseline does, up to its max
    # no cool-down, no min and no backlog keep a capped pool up
    held = replace(SPOT, month_spend=600.0, last_change=NOW - 1, config=SPOT.config.model_copy(update={"min": 2}))
    assert {d.pool: d.desired for d in decide(0, [BASE, held], CFG, NOW)}["spot"] == 0


def test_the_stores_budget_record_reads_back_and_a_bad_one_is_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(str(tmp_path / "store"))
    assert load(store, "j-1") is None
    save(store, "j-1", Record(budget=2.5, spent=1.25, reached=1_800_000_000.0))
    assert load(store, "j-1") == Record(job="j-1", budget=2.5, spent=1.25, reached=1_800_000_000.0)
    save(store, "j-1", Record(budget=2.5, spent=0.0))
    assert load(store, "j-1") == Record(job="j-1", budget=2.5, spent=0.0, reached=None)
    save(store, "j-1", Record(budget=2.5, spent=0.0, prices={"gen": 2.0}))
    assert load(store, "j-1") == Record(job="j-1", budget=2.5, spent=0.0, prices={"gen": 2.0})
    for bad in (b"{not json", b"[]", b'{"budget": -1}', b'{"budget": 3, "spent": "x"}', b'{"budget": 3, "spent": -2}'):
        store.put(spec.budget_key("j-1"), bad)
        assert load(store, "j-1") is None, bad
    assert "not a budget record" in caplog.text and spec.budget_key("j-1") in caplog.text


def test_the_monitor_writes_the_record_at_the_stop_and_every_tenth_of_the_budget() -> None:
    assert record_due(10.0, 0.0, False, None)  # first sight
    assert not record_due(10.0, 0.9, False, 0.0) and record_due(10.0, 1.0, False, 0.0)
    assert record_due(10.0, 9.95, True, 9.5) and not record_due(10.0, 9.95, True, 9.95)  # stopped: once


def test_a_spend_carried_over_a_lost_redis_shows_on_the_budget_line() -> None:
    job = JobStatus("j-0123456789abcdef", 40, 10, 0, 30, 0, 5, 4, 0, True, gpu_seconds={"default": 500.0})
    job.budget, job.budget_carried = 2.0, 0.75
    price(job, {"default": 3.6})
    console = Console(width=200, record=True, color_system=None)
    console.print(render_status(FleetStatus(jobs=[job], prices={"default": 3.6}), console))
    assert "0.75 spent before Redis lost the job counts too" in console.export_text()
    assert job.to_dict()["budget_carried"] == 0.75


def test_the_least_budget_quoted_is_rounded_up_and_above_the_spend() -> None:
    # Up, never down: the figure typed back is never below the spend and the batches it counts.
    assert ceil_money(0.0043) == 0.0043 and ceil_money(0.00431234) == 0.00432 and ceil_money(24.851) == 24.86
    assert ceil_money(1234.561) == 1234.57 and ceil_money(4e-7) == 1e-6  # cents above 10; 6 places at most
    # Its spend, the batch of each running shard and one a worker serving it (at least one).
    assert least_budget(Spent(0.003225, 0.0004, 0), 2) == 0.00403
    assert least_budget(Spent(0.003225, 0.0004, 1), 2) == 0.00443
    assert least_budget(Spent(0.003225, 0.0004, 0), 0) == 0.00363
    assert least_budget(Spent(0.003, None, 0), 3) > 0.003  # no batch counted: the least above the spend
    line = go_on("j-1", Spent(0.003225, 0.0004, 0), 2)
    assert line.startswith("`renderfleet resume j-1 --budget 0.00403` or more continues it")
    assert "2 batches of about 0.0004 at its prices, one for each of the 2 workers serving it" in line
