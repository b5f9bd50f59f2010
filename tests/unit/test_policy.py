"""The pool-sizing policy, rule by rule (see dispatcher/fleet/policy.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dispatcher.fleet.policy import (
    CARD,
    POOL,
    Decision,
    NodeDecision,
    PoolState,
    decide,
    fill_order,
    recent_lost_fraction,
    to_nodes,
)
from renderfleet.settings import AutoscaleConfig, PoolConfig

CFG = AutoscaleConfig(drain_seconds=600, cooldown_seconds=120, cold_start_seconds=60, scale_in_margin=0.7)
BASE = PoolState("baseline", PoolConfig(kind="on-demand", price_per_hour=2.0, min=1, max=4), current=1, ready=1)
SPOT = PoolState("spot", PoolConfig(kind="spot", price_per_hour=0.8, min=0, max=8), current=0, ready=0)
NOW = 10_000.0


def sizes(decisions: list[Decision]) -> dict[str, int]:
    return {d.pool: d.desired for d in decisions}


def test_rule_1_the_baseline_stays_at_its_floor_with_no_backlog() -> None:
    out = decide(0, [BASE, SPOT], CFG, NOW)
    assert sizes(out) == {"baseline": 1, "spot": 0}
    grown = replace(BASE, current=0, ready=0)
    assert sizes(decide(0, [grown, SPOT], CFG, NOW))["baseline"] == 1  # brought back up to its min


def test_rule_2_the_overflow_goes_to_spot_sized_by_work_seconds() -> None:
    # 1 baseline worker clears 600 s of work per 600 s: 3,000 s needs 5 workers' worth, 4 more from spot.
    out = sizes(decide(3_000, [BASE, SPOT], CFG, NOW))
    assert out == {"baseline": 1, "spot": 4}
    # capped at the pool's max
    assert sizes(decide(60_000, [BASE, SPOT], CFG, NOW))["spot"] == 8


def test_rule_2_the_cheapest_spot_pool_per_image_fills_first() -> None:
    pricey_fast = PoolState("spot-h100", PoolConfig(kind="spot", price_per_hour=3.0, max=4), 0, 0, speed=2.0, measured=POOL)
    cheap_slow = PoolState("spot-l4", PoolConfig(kind="spot", price_per_hour=0.5, max=2), 0, 0, speed=0.5, measured=POOL)
    # per work-second: l4 costs 1.0/h-equivalent, h100 1.5: l4 first, h100 takes the rest
    out = sizes(decide(6_000, [BASE, pricey_fast, cheap_slow], CFG, NOW))
    assert out["spot-l4"] == 2
    assert out["spot-h100"] == 4  # 10 needed - 1 base - 1 (two l4 at 0.5) = 8 -> 4 at speed 2


def test_rule_3_a_backlog_the_warm_workers_clear_within_two_cold_starts_wakes_nothing() -> None:
    # 100 s of work, 1 warm worker: done in 100 s, under 2 x 60 s of cold start
    out = decide(100, [BASE, SPOT], CFG, NOW)
    assert sizes(out) == {"baseline": 1, "spot": 0}
    assert "nothing new woken" in out[1].reason
    # beyond two cold starts but within drain: still nothing to wake (the floor clears it in time)
    assert sizes(decide(500, [BASE, SPOT], CFG, NOW))["spot"] == 0


def test_rule_4_a_recently_reclaimed_spot_pool_counts_for_less() -> None:
    healthy = sizes(decide(3_000, [BASE, SPOT], CFG, NOW))["spot"]
    reclaimed = sizes(decide(3_000, [BASE, replace(SPOT, lost_fraction=0.5)], CFG, NOW))["spot"]
    assert (healthy, reclaimed) == (4, 8)


MINUTE = 60.0
WALL = 1_800_000_000.0  # a unix time on a minute's boundary
M = int(WALL // MINUTE)  # its minute


def test_rule_4_the_reclaim_rate_is_recent_work_lost_over_work_started_in_the_window() -> None:
    buckets = {
        M - 20: {"started_images": 100, "wasted_images": 100},  # a bad hour, 20 minutes ago
        M - 10: {"started_images": 40, "wasted_images": 8},
        M: {"started_images": 40, "wasted_images": 2},
    }
    assert recent_lost_fraction(buckets, WALL + 30, 15 * MINUTE, MINUTE) == 10 / 80
    # The same counters, read over an hour: the old reclaims count again.
    assert recent_lost_fraction(buckets, WALL + 30, 60 * MINUTE, MINUTE) == 110 / 180


def test_rule_4_a_pool_whose_reclaims_are_over_is_trusted_again() -> None:
    buckets = {M: {"started_images": 64, "wasted_images": 32}}
    assert recent_lost_fraction(buckets, WALL + 30, 15 * MINUTE, MINUTE) == 0.5
    assert recent_lost_fraction(buckets, WALL + 14 * MINUTE, 15 * MINUTE, MINUTE) == 0.5  # still inside
    later = WALL + 16 * MINUTE + 1
    assert recent_lost_fraction(buckets, later, 15 * MINUTE, MINUTE) == 0.0  # out of the window
    lost = recent_lost_fraction(buckets, later, 15 * MINUTE, MINUTE)
    assert sizes(decide(3_000, [BASE, replace(SPOT, lost_fraction=lost)], CFG, NOW))["spot"] == 4  # undiscounted


def test_rule_4_nothing_started_is_nothing_lost_and_never_more_than_all() -> None:
    assert recent_lost_fraction({}, WALL, 15 * MINUTE, MINUTE) == 0.0
    # A batch started before the window and abandoned inside it.
    assert recent_lost_fraction({M: {"started_images": 4, "wasted_images": 8}}, WALL, 15 * MINUTE, MINUTE) == 1.0


def test_rule_4_the_reason_says_how_much_a_reclaimed_pool_counts_for() -> None:
    out = decide(3_000, [BASE, replace(SPOT, lost_fraction=0.25)], CFG, NOW)
    spot = next(d for d in out if d.pool == "spot")
    assert "counted at 75%" in spot.reason and "25% of its work" in spot.reason


def test_rule_5_no_spot_capacity_grows_the_baseline_up_to_its_max() -> None:
    starving = replace(SPOT, current=4, ready=0, pending_since=NOW - 61)  # asked 61 s ago, nothing came
    out = decide(3_000, [BASE, starving], CFG, NOW)
    assert sizes(out)["baseline"] == 4 and "spot cannot" in out[0].reason
    said_no = replace(SPOT, no_capacity=True)
    assert sizes(decide(3_000, [BASE, said_no], CFG, NOW))["baseline"] == 4
    # still waiting within a cold start: no fallback yet
    waiting = replace(SPOT, current=4, ready=0, pending_since=NOW - 30)
    assert sizes(decide(3_000, [BASE, waiting], CFG, NOW)) == {"baseline": 1, "spot": 4}


def test_rule_6_scale_in_waits_out_the_cool_down_and_goes_one_step_at_a_time() -> None:
    big = replace(SPOT, current=4, ready=4, last_change=NOW - 30)
    assert sizes(decide(0, [BASE, big], CFG, NOW))["spot"] == 4  # cooling down
    cooled = replace(big, last_change=NOW - 121)
    out = decide(0, [BASE, cooled], CFG, NOW)
    assert sizes(out)["spot"] == 3 and out[1].change == -1


def test_rule_6_spot_shrinks_before_the_baseline_and_nothing_goes_below_min() -> None:
    base = replace(BASE, current=3, ready=3, last_change=NOW - 500)
    spot = replace(SPOT, current=2, ready=2, last_change=NOW - 500)
    out = sizes(decide(0, [base, spot], CFG, NOW))
    assert out == {"baseline": 3, "spot": 1}
    out = sizes(decide(0, [base, replace(spot, current=0, ready=0)], CFG, NOW))
    assert out == {"baseline": 2, "spot": 0}
    at_min = sizes(decide(0, [replace(BASE, last_change=NOW - 500), replace(spot, current=0)], CFG, NOW))
    assert at_min == {"baseline": 1, "spot": 0}


def test_rule_6_no_flapping_a_worker_stays_while_one_fewer_would_not_clear_the_backlog_well_in_time() -> None:
    # 4 spot + 1 base = 5 workers' worth: 2,400 s is 480 s of work each, within 600 s.
    # Grown for 3,000 s; now 2,400 s left: the target is 3 spot, but 4 workers would
    # take 600 s > 0.7 x 600: keep 4.
    spot = replace(SPOT, current=4, ready=4, last_change=NOW - 500)
    assert sizes(decide(2_400, [BASE, spot], CFG, NOW))["spot"] == 4
    # 1,200 s left: 4 workers take 300 s (< 420): one step in
    assert sizes(decide(1_200, [BASE, spot], CFG, NOW))["spot"] == 3
    # and the same backlog a moment later does not grow it back
    after = replace(spot, current=3, ready=3, last_change=NOW)
    assert sizes(decide(1_200, [BASE, after], CFG, NOW + 1))["spot"] == 3


def test_every_decision_says_why_in_words() -> None:
    for backlog in (0, 100, 3_000, 60_000):
        for d in decide(backlog, [BASE, SPOT], CFG, NOW):
            assert len(d.reason.split()) >= 3, d


def test_rule_7_the_fleet_grows_no_further_than_its_redis_takes_cheapest_pool_first() -> None:
    pricey = PoolState("spot-h100", PoolConfig(kind="spot", price_per_hour=3.0, max=8), 0, 0)
    cheap = replace(SPOT, config=SPOT.config.model_copy(update={"max": 2}))
    free = sizes(decide(6_000, [BASE, cheap, pricey], CFG, NOW))
    assert free == {"baseline": 1, "spot": 2, "spot-h100": 7}
    out = decide(6_000, [BASE, cheap, pricey], CFG, NOW, redis_room=(4, "Redis has 7,980 of its 10,000 clients"))
    assert sizes(out) == {"baseline": 1, "spot": 2, "spot-h100": 2}  # 4 more in all: the cheap pool's first
    (capped,) = [d for d in out if d.pool == "spot-h100"]
    assert capped.reason.startswith("2, not 7: Redis has 7,980 of its 10,000 clients (")
    # Room for none: nothing grows; a pool shrinking or holding is left alone, room or not.
    held = decide(6_000, [replace(BASE, current=2, ready=2), cheap, pricey], CFG, NOW, redis_room=(0, "busy"))
    assert sizes(held) == {"baseline": 2, "spot": 0, "spot-h100": 0}
    assert sizes(decide(0, [BASE, SPOT], CFG, NOW, redis_room=(0, "busy"))) == sizes(decide(0, [BASE, SPOT], CFG, NOW))


def test_rule_7_workers_asked_for_and_not_up_yet_take_their_share_of_the_room_first() -> None:
    booting = PoolState("spot-h100", PoolConfig(kind="spot", price_per_hour=3.0, max=20), current=3, ready=1)
    free = sizes(decide(12_000, [BASE, booting], CFG, NOW))["spot-h100"]
    assert free > 6
    # Room for 4 as Redis sees it; 2 of the 3 asked for have not connected yet: 2 more, not 4.
    out = decide(12_000, [BASE, booting], CFG, NOW, redis_room=(4, "Redis has 7,980 of its 10,000 clients"))
    (capped,) = [d for d in out if d.pool == "spot-h100"]
    assert capped.desired == 5 and "2 asked for and not up yet" in capped.reason
    # Booting workers beyond the room: nothing more, never fewer than asked for already.
    stuck = replace(booting, current=8, ready=1)
    assert sizes(decide(12_000, [BASE, stuck], CFG, NOW, redis_room=(4, "busy")))["spot-h100"] == 8


# Rule 9: nodes of several GPUs. Four GPUs a node (g6.12xlarge), priced per node.
QUAD = PoolState(
    "spot-4x",
    PoolConfig(kind="spot", price_per_hour=3.2, price_per="node", gpus_per_node=4, min=0, max=16),
    current=0,
    ready=0,
)


def test_rule_9_a_pool_of_nodes_grows_in_whole_nodes_and_is_priced_per_gpu() -> None:
    # 3,000 s needs 5 workers' worth: 4 beyond the baseline, one node; 5 beyond it, two nodes (8 GPUs).
    assert sizes(decide(3_000, [BASE, QUAD], CFG, NOW))["spot-4x"] == 4
    out = decide(3_600, [BASE, QUAD], CFG, NOW)
    assert sizes(out)["spot-4x"] == 8 and "at 0.8/h" in out[1].reason  # 3.2 a node of 4: 0.8 a GPU
    assert QUAD.cost_per_work_second == SPOT.cost_per_work_second  # the same price per GPU-hour as SPOT's
    assert sizes(decide(60_000, [BASE, QUAD], CFG, NOW))["spot-4x"] == 16  # its max, whole nodes
    # Redis's room for 6 more workers gives one node of 4, never a part of a second (the pool listed first:
    # with nothing measured, the room goes in the configured order, rule 10).
    assert sizes(decide(60_000, [QUAD, BASE], CFG, NOW, redis_room=(6, "Redis")))["spot-4x"] == 4


def test_rule_9_a_pool_of_nodes_shrinks_a_node_at_a_time() -> None:
    big = replace(QUAD, current=12, ready=12, last_change=NOW - 1_000)
    (_, spot) = decide(0, [BASE, big], CFG, NOW)
    assert spot.desired == 8 and spot.reason.startswith("one step in")
    # Hysteresis counts the whole node: 3 nodes clear 2,000 s in 154 s; 2 would take 222 s, within 420.
    assert sizes(decide(2_000, [BASE, big], CFG, NOW))["spot-4x"] == 8
    # 4,000 s: without the node, 444 s > 0.7 x 600: it stays.
    assert sizes(decide(4_000, [BASE, big], CFG, NOW))["spot-4x"] == 12


def test_rule_9_gpus_become_nodes_rounded_up_and_never_below_nodes_with_work_in_flight() -> None:
    cfg = QUAD.config
    grow = Decision("spot-4x", 4, 8, "backlog")
    assert to_nodes(grow, cfg, current_nodes=1, busy_nodes=1) == NodeDecision(
        "spot-4x", 1, 2, 8, "2 node(s) of 4 GPUs: backlog"
    )
    assert to_nodes(Decision("spot-4x", 0, 5, "x"), cfg, 0, 0).desired == 2  # 5 GPUs: 2 nodes, rounded up
    # Down to one node, but all three hold a shard: none is stopped under its work.
    shrink = to_nodes(Decision("spot-4x", 12, 4, "one step in"), cfg, current_nodes=3, busy_nodes=3)
    assert (shrink.desired, shrink.gpus, shrink.change) == (3, 12, 0)
    assert shrink.reason.startswith("keeps 3 node(s), not 1: 3 hold work in flight")
    # Two busy: one node goes (the idle one: the backends pick idle first).
    assert to_nodes(Decision("spot-4x", 12, 4, "in"), cfg, 3, 2).desired == 2
    # Busy nodes never make a pool grow (a node busy and already asked to go is not asked back).
    assert to_nodes(Decision("spot-4x", 4, 0, "in"), cfg, current_nodes=1, busy_nodes=2).desired == 1
    # The monthly budget (rule 8) stops it all the same: money is the one reason to hand work back.
    assert to_nodes(Decision("spot-4x", 12, 0, "budget"), cfg, 3, 3, capped=True).desired == 0
    # One GPU a node: workers, held the same way.
    one = to_nodes(Decision("spot", 3, 2, "in"), SPOT.config, current_nodes=3, busy_nodes=3)
    assert (one.desired, one.reason[:33]) == (3, "keeps 3 worker(s), not 2: 3 hold ")


def test_the_local_backend_starts_one_node_supervisor_of_n_gpus_per_node_and_one_worker_elsewhere() -> None:
    from dispatcher.fleet.autoscale import LocalBackend

    pools = {"spot-4x": QUAD.config, "spot": SPOT.config}
    local = LocalBackend(None, store="/s", env={}, log_dir=Path("/nowhere"), model="tiny", pools=pools)  # type: ignore[arg-type]
    assert local.start_args("spot-4x") == ["--pool", "spot-4x", "--model", "tiny", "--gpus", "4"]
    assert local.start_args("spot") == ["--pool", "spot", "--model", "tiny"]  # one GPU a node: a worker, as before


# ---- rule 10: mixed cards, routed by measured cost per image --------------------------------------------


def _card_pool(name: str, price: float, seconds_per_image: float | None, card: str) -> PoolState:
    """A spot pool of ``card``; with ``seconds_per_image``, measured there for the backlog's kind of image
    (its speed against the reference worker's 1 s of work per image, as autoscale turns it)."""
    cfg = PoolConfig(kind="spot", price_per_hour=price, max=6, card=card)
    if seconds_per_image is None:
        return PoolState(name, cfg, 0, 0)
    return PoolState(
        name,
        cfg,
        0,
        0,
        speed=1.0 / seconds_per_image,
        measured=CARD,
        card=card,
        seconds_per_image=seconds_per_image,
        routed_for="sd-turbo 512x512, 4 steps",
    )


def test_rule_10_the_card_with_the_lowest_measured_cost_per_image_fills_first_whatever_the_configured_order() -> None:
    # Per image: the L4 0.8/h x 2 s = 0.00044, the H100 3.0/h x 0.4 s = 0.00033: the pricier card is cheaper.
    l4 = _card_pool("spot-l4", 0.8, 2.0, "NVIDIA L4")
    h100 = _card_pool("spot-h100", 3.0, 0.4, "NVIDIA H100 80GB HBM3")
    assert [p.name for p in fill_order([l4, h100])] == ["spot-h100", "spot-l4"]
    out = decide(1_500, [BASE, l4, h100], CFG, NOW)
    # 2.5 workers' worth needed, 1 from the floor: one H100 (2.5 each) does it; the L4 pool stays empty.
    assert sizes(out) == {"baseline": 1, "spot-l4": 0, "spot-h100": 1}
    (h,) = [d for d in out if d.pool == "spot-h100"]
    assert "0.0003333 per image measured on NVIDIA H100 80GB HBM3 (0.4 s each, sd-turbo 512x512, 4 steps)" in h.reason
    # A pool measured beats one that is not, which comes after, in the configured order.
    unknown = _card_pool("spot-a10", 0.2, None, "NVIDIA A10G")
    assert [p.name for p in fill_order([unknown, l4, h100])] == ["spot-h100", "spot-l4", "spot-a10"]
    # 21 workers' worth: 1 from the floor, 15 from six H100s, 3 from six L4s, the last 2 from the A10s.
    busy = decide(12_600, [BASE, unknown, l4, h100], CFG, NOW)
    assert sizes(busy) == {"baseline": 1, "spot-h100": 6, "spot-l4": 6, "spot-a10": 2}
    (a,) = [d for d in busy if d.pool == "spot-a10"]
    assert "nothing measured on it yet: after the measured pools, in the configured order" in a.reason


def test_rule_10_with_nothing_measured_the_pools_fill_in_the_configured_order_and_say_so() -> None:
    # Unmeasured, the pricier pool listed first fills first: price alone says nothing of a card's speed.
    first = _card_pool("spot-h100", 3.0, None, "NVIDIA H100 80GB HBM3")
    second = _card_pool("spot-l4", 0.8, None, "NVIDIA L4")
    assert [p.name for p in fill_order([first, second])] == ["spot-h100", "spot-l4"]
    assert [p.name for p in fill_order([second, first])] == ["spot-l4", "spot-h100"]
    out = decide(3_000, [BASE, first, second], CFG, NOW)
    assert sizes(out) == {"baseline": 1, "spot-h100": 4, "spot-l4": 0}
    (d,) = [d for d in out if d.pool == "spot-h100"]
    assert d.reason.endswith("; nothing measured yet on any pool: the configured order"), d.reason
    # Redis's room (rule 7) goes in the same order.
    roomy = decide(6_000, [BASE, first, second], CFG, NOW, redis_room=(3, "busy"))
    assert sizes(roomy) == {"baseline": 1, "spot-h100": 3, "spot-l4": 0}


# ---- rule 11: work that needs a big card grows only the pools whose card takes it -----------------------


def test_rule_11_work_of_min_vram_jobs_grows_only_the_pools_whose_card_qualifies_and_the_reasons_say_so() -> None:
    # Per image the L4 (0.5/h x 2 s = 0.00028) is cheaper than the H100 (3.0/h x 0.4 s = 0.00033): it fills first...
    l4 = replace(_card_pool("spot-l4", 0.5, 2.0, "NVIDIA L4"), vram_gib=22.5)
    h100 = replace(_card_pool("spot-h100", 3.0, 0.4, "NVIDIA H100 80GB HBM3"), vram_gib=79.6)
    assert sizes(decide(3_000, [BASE, l4, h100], CFG, NOW)) == {"baseline": 1, "spot-l4": 6, "spot-h100": 1}
    # ... but 1,800 s of the 3,000 need 40 GB: 3 workers' worth that only H100s take (2 of them, 5 worth),
    # which clear the rest too; the L4 pool is not grown for it.
    out = decide(3_000, [BASE, l4, h100], CFG, NOW, needs={40: 1_800})
    assert sizes(out) == {"baseline": 1, "spot-l4": 0, "spot-h100": 2}
    why = {d.pool: d.reason for d in out}
    assert "1800 s of work that needs a card of >= 40 GB (NVIDIA H100 80GB HBM3, 79.6 GiB takes it)" in why["spot-h100"]
    assert "1800 s of the backlog needs a card of >= 40 GB (NVIDIA L4, 22.5 GiB): not counted here" in why["spot-l4"]
    # A card of unknown memory (the baseline here) takes none of it either.
    assert "(its card, memory unknown): not counted here" in why["baseline"]
    # Nested shares: 80 GB work counts toward 40's too; the rest of the backlog fills cheapest first.
    a100 = replace(_card_pool("spot-a100", 1.4, 0.8, "NVIDIA A100-SXM4-40GB"), vram_gib=39.4)  # 0.00031 per image
    pools = [BASE, l4, a100, h100]
    # Any card's work alone: 11 workers' worth, 1 from the floor, 3 from six L4s, the rest from six A100s.
    assert sizes(decide(6_600, pools, CFG, NOW)) == {"baseline": 1, "spot-l4": 6, "spot-a100": 6, "spot-h100": 0}
    # 80 GB: 2.5 worth, one H100; 40 GB: 2 worth, two A100s (0.5 over); the rest, 6.5 worth: 1 from the floor,
    # 0.5 over, 3 from six L4s, 2 from two more A100s.
    mixed = decide(6_600, pools, CFG, NOW, needs={80: 1_500, 40: 1_200})
    assert sizes(mixed) == {"baseline": 1, "spot-l4": 6, "spot-a100": 4, "spot-h100": 1}
    why = {d.pool: d.reason for d in mixed}
    assert "1500 s of the backlog needs a card of >= 80 GB (NVIDIA A100-SXM4-40GB, 39.4 GiB)" in why["spot-a100"]
    assert "3900 s of work that any card takes" in why["spot-l4"]


def test_rule_11_work_no_pool_here_takes_grows_none_and_keeps_none_from_scaling_in() -> None:
    l4 = replace(_card_pool("spot-l4", 0.5, 2.0, "NVIDIA L4"), vram_gib=22.5)
    # All of the backlog needs 48 GB: no pool takes it, so none grows for it.
    out = decide(3_000, [BASE, l4], CFG, NOW, needs={48: 3_000})
    assert sizes(out) == {"baseline": 1, "spot-l4": 0}
    assert "3000 s of the backlog needs a card of >= 48 GB (NVIDIA L4, 22.5 GiB): not counted here" in out[1].reason
    # Six L4s up, past the cool-down: that backlog does not keep them (one step in, spot first).
    up = replace(l4, current=6, ready=6, last_change=NOW - 1_000)
    assert sizes(decide(3_000, [BASE, up], CFG, NOW, needs={48: 3_000}))["spot-l4"] == 5
    # The same backlog any card takes keeps them: one fewer would not clear it well in time.
    kept = decide(3_000, [BASE, up], CFG, NOW)
    assert sizes(kept)["spot-l4"] == 6
    # An H100 pool up holds for the big work: one fewer would not clear it, and the reason names it.
    h100 = PoolState(
        "spot-h100", PoolConfig(kind="spot", price_per_hour=3.0, max=6), 2, 2, last_change=NOW - 1_000, vram_gib=79.6
    )
    assert sizes(decide(500, [BASE, h100], CFG, NOW))["spot-h100"] == 1  # any card's: the baseline helps
    held = decide(500, [BASE, h100], CFG, NOW, needs={40: 500})
    assert sizes(held)["spot-h100"] == 2
    assert "one fewer would not clear the 500 s of work that needs a card of >= 40 GB" in held[1].reason
    # Rule 3 asks each share of the warm workers whose card takes it: warm L4s do not leave big work waiting.
    cold = [BASE, replace(l4, current=2, ready=2), replace(h100, current=0, ready=0)]
    assert "nothing new woken" in decide(100, cold, CFG, NOW)[0].reason
    woken = decide(100, cold, CFG, NOW, needs={40: 100})
    assert sizes(woken)["spot-h100"] == 1 and "nothing new woken" not in woken[0].reason
