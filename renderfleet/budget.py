"""A job's budget: the most it may spend, and what happens when its spend reaches it.

A job's spend is its GPU time by pool (``render_ms.<pool>`` in ``keys.job_stats``, counted by the
workers' ledgers, and ``killed_ms.<pool>``, the reaper's count of what a killed holder lost) times each
pool's price per GPU-hour: what ``status`` shows as its cost.  The prices are the job's own, pinned at
submit (``budget_prices`` in the job's hash and in the store's record: :func:`pinned`): every price
the submitter knew (its config's over those the fleet published), so the budget binds whatever the
workers, a monitor or a Redis restart know of prices.  Submit refuses a budget when the job's pool or a
pool of its stages has no price (:func:`unpriced_problem`); a pool that has none and renders the job
all the same (one that also serves ``default``) counts at the dearest of the job's prices: a budget
may bind early, never late.  ``submit --budget USD`` writes the cap in the
job's hash (``budget``); the check runs where the GPU time is counted, inside the fence check's
script (``renderfleet/lua/fence.lua``), so it is atomic and costs no round trip: once the spend, and
the batch the worker renders meanwhile, reach the cap, the script marks the job (``budget_reached``,
``budget_spent``) and cancels it (``cancelled``), and from there the job stops exactly as a cancel
stops it: the feeder skips it, a claim drops its messages, a running shard ends at its next batch
boundary and is parked, and the worker whose check marked it takes its queued messages out
(:func:`stop`, one pass of ``renderfleet/lua/cancel.lua``).  A worker rendering a job with a budget
asks Redis before each batch whether the mark is set (``worker/lease/ledger.py``): no batch of it begins
after its budget is reached, so a job overshoots by at most the batch each worker had in flight.

``resume --budget USD`` raises the cap (:func:`raise_budget`) and continues the job; a plain
``resume`` of a job stopped at its budget is refused (it would stop again at the next batch).

The cap is kept in the store too (``spec.budget_key``: the budget and the job's spend last known), written
at submit and by ``resume --budget`` and brought up to date by the monitor (at most every tenth of the
budget, and when the job stops at it): a Redis that lost its memory loses the job's GPU time with it, so
the resume that registers the job again (:func:`restore`) sets its cap and carries that spend
(``budget_carried``, counted by ``fence.lua`` with the GPU time counted since).  What the job spent after
the record was last written is lost with Redis: it may spend that again (docs/pools.md, "Budgets").

Here, below both sides: the worker stops a job, the dispatcher raises its cap and shows it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from decimal import ROUND_CEILING, Decimal
from typing import Any, NamedTuple

import redis

from renderfleet import keys, schemas, spec
from renderfleet.errors import InputError
from renderfleet.jobfailure import cancel_call
from renderfleet.leases import lua_script
from renderfleet.limits import MAX_BUDGET_RECORD_BYTES
from renderfleet.states import ShardState
from renderfleet.store import Store, read_record
from renderfleet.words import counted

log = logging.getLogger("renderfleet.budget")

BUDGET = "budget"  # keys.job: the most the job may spend, in the pools' currency
REACHED = "budget_reached"  # keys.job: unix time its spend reached the budget (fence.lua)
SPENT = "budget_spent"  # keys.job: its spend when the mark was set
FIELDS = (BUDGET, REACHED, SPENT)  # in this order wherever they are read together
CARRIED = "budget_carried"  # keys.job: its spend before this Redis took it back (the store's record), counted too
RENDER_MS = "render_ms."  # the job's GPU-ms of one pool: keys.job_stats field render_ms.<pool>
KILLED_MS = "killed_ms."  # what a killed holder of one pool lost (renderfleet/lua/reap.lua): spent too
SPENT_FIELDS = (RENDER_MS, KILLED_MS)  # the job's counters its spend counts (renderfleet/lua/fence.lua too)
PRICES = "budget_prices"  # keys.job: the job's prices (JSON pool -> per hour), pinned at submit


def budget_problem(value: object) -> str | None:
    """Why ``value`` is not a budget (a positive, finite amount of money), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"a budget is an amount of money (a number), got {value!r}"
    if not math.isfinite(value) or value <= 0:
        return f"a budget is a positive amount of money, got {value!r}"
    return None


def unpriced_problem(budget: float, pools: str | Iterable[str], prices: Mapping[str, float]) -> str | None:
    """Why a job rendered on ``pools`` (its own and its stages') cannot have ``budget`` (one of them has no
    price: its spend there could not be counted), or None."""
    pool = next((p for p in ([pools] if isinstance(pools, str) else pools) if not prices.get(p, 0) > 0), None)
    if pool is None:
        return None
    return (
        f"--budget {budget:g}: pool {pool!r} has no price per hour, so the job's spend cannot be counted: "
        f"set price_per_hour in [pools.{pool}] of the config (--config FILE), or let a fleet that has it "
        "publish it (a worker, the autoscaler or a monitor started with the config)"
    )


def spend(stats: Mapping[str, int], prices: Mapping[str, float]) -> float:
    """A job's spend from its counters (``keys.job_stats``) at ``prices`` (pool -> per hour): what
    ``fence.lua`` counts, for the dispatcher's side.  A pool with no price counts at the dearest."""
    dearest = max(prices.values(), default=0.0)
    return sum(
        ms * prices.get(field.removeprefix(use), dearest) / 3_600_000
        for field, ms in stats.items()
        for use in SPENT_FIELDS
        if field.startswith(use)
    )


def pinned(prices: Mapping[str, float]) -> dict[str, float]:
    """The prices a budgeted job pins (those above 0), as its hash and its record keep them."""
    return {
        pool: float(p) for pool, p in sorted(prices.items()) if isinstance(p, int | float) and math.isfinite(p) and p > 0
    }


def read_prices(raw: object) -> dict[str, float] | None:
    """A job's pinned prices from their JSON (its hash's ``budget_prices``, its record's ``prices``);
    None when unset or not a map of pool to price (an older job: counted at the fleet's prices)."""
    if raw is None or raw == b"" or raw == "":
        return None
    try:
        data = json.loads(raw if isinstance(raw, str | bytes) else json.dumps(raw))
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        return None
    prices = pinned(data)
    return prices if len(prices) == len(data) else None


def job_prices(client: redis.Redis, job: str) -> dict[str, float] | None:
    """The prices ``job`` pinned (None: it has none)."""
    return read_prices(client.hget(keys.job(job), PRICES))


def projected(cost: float | None, done: int, total: int) -> float | None:
    """The job's whole cost at the rate so far: its spend per image rendered times every image; None
    while no image is done or its spend is unknown."""
    if cost is None or done <= 0:
        return None
    return cost / done * total


def stop(client: redis.Redis, job: str, at: str = "") -> None:
    """The job's queued messages out of their queues and its pending shards parked: one pass of
    ``cancel.lua``, by the worker whose fence check marked the job (``at``: the mark's time).  Its
    running shards stop at their next batch boundary.  ``redis.RedisError`` when Redis cannot answer
    (the feeder and the claim skip the job all the same: only its parking waits for a resume)."""
    script_keys, args = cancel_call(job, fence=False, when=at)
    client.register_script(lua_script("cancel"))(keys=script_keys, args=args)


def mark(client: redis.Redis, job: str) -> tuple[float | None, float | None, float | None]:
    """(its budget, when it was reached, its spend then) from the job's hash; each None when unset."""
    raw = client.hmget(keys.job(job), *FIELDS)
    return tuple(_number(v) for v in raw)  # type: ignore[return-value]


def _number(raw: object) -> float | None:
    try:
        value = float(keys.text(raw))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def set_budget(client: redis.Redis, job: str, budget: float, prices: Mapping[str, float]) -> None:
    """Write a new job's budget and the prices its spend is counted at (submit, after registering it
    afresh: nothing of an earlier life is kept)."""
    client.hset(keys.job(job), mapping={BUDGET: f"{budget:.6f}", PRICES: json.dumps(pinned(prices))})


class Spent(NamedTuple):
    """A job's spend as the fence check counts it now (:func:`spent_now`), and what one batch of it costs."""

    spent: float  # its counters at its pinned prices, and what it carried over a lost Redis
    batch: float | None  # its mean render cost a batch so far at those prices; None before a batch is counted
    running: int  # its shards still leased: each is finishing a batch that is not counted yet


def spent_now(
    client: redis.Redis, job: str, prices: Mapping[str, float] | None = None, carried: float | None = None
) -> Spent:
    """The job's spend as ``fence.lua`` reads it when this is called: its GPU-ms by pool (rendered and
    killed) at its pinned prices (else ``prices``), and ``carried`` (default: its hash's ``budget_carried``).
    The mark's ``budget_spent`` is older: the batch each worker had in flight then is counted after it."""
    at = job_prices(client, job) or pinned(prices or {})
    stats = {keys.text(k): int(v) for k, v in client.hgetall(keys.job_stats(job)).items()}
    if carried is None:
        carried = _number(client.hget(keys.job(job), CARRIED)) or 0.0
    rendered = {field: ms for field, ms in stats.items() if field.startswith(RENDER_MS)}
    batches = stats.get("batches", 0)
    running = sum(keys.text(s) == ShardState.RUNNING for s in client.hvals(keys.shards(job)))
    return Spent(spend(stats, at) + carried, spend(rendered, at) / batches if batches > 0 else None, running)


def ceil_money(value: float) -> float:
    """``value`` rounded up to 3 significant figures, or to cents above 10 (never finer than the 6 decimals
    a budget is kept at): typed back as a budget, it is never below ``value``."""
    if value <= 0:
        return 0.0
    places = min(6, max(2, 2 - math.floor(math.log10(value))))
    return float(Decimal(repr(value)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_CEILING))


def least_budget(now: Spent, workers: int) -> float:
    """The smallest budget that lets the job go on: its spend now, the batch each running shard is
    finishing, and one more batch for each worker that serves it (at least one), rounded up.  With it the
    job renders about one batch per worker and stops at its budget again.  Without a batch counted yet,
    the least amount above its spend (any budget above it lets each worker render one batch)."""
    batches = now.running + max(1, workers)
    least = ceil_money(now.spent + batches * (now.batch or 0.0))
    if least <= now.spent:  # above the spend, or the budget is refused: one step of its last place up
        least = ceil_money(now.spent * (1 + 1e-3) + 1e-6)
    return least


def go_on(job: str, now: Spent, workers: int) -> str:
    """How to continue a job at its budget, the figure to type first: ``renderfleet resume JOB --budget
    LEAST`` (:func:`least_budget`) and what it buys."""
    least = least_budget(now, workers)
    shown = f"{least:.6f}".rstrip("0").rstrip(".")  # every decimal ceil_money kept: typed back, the same figure
    command = f"`renderfleet resume {job} --budget {shown}`"
    if now.batch is None:
        return f"{command} or more continues it (the least above its spend: each worker renders one batch)"
    batches = now.running + max(1, workers)
    what = {0: "one for a worker (none serves it now)", 1: "one for the worker serving it"}.get(
        workers, f"one for each of the {workers} workers serving it"
    )
    if now.running:
        what += f", and {counted(now.running, 'batch', 'batches')} of running shards not counted yet"
    return (
        f"{command} or more continues it ({shown}: its spend and {counted(batches, 'batch', 'batches')} "
        f"of about {now.batch:.2g} at its prices, {what}; more goes further)"
    )


def raise_budget(
    client: redis.Redis,
    job: str,
    budget: float,
    prices: Mapping[str, float],
    carried: float | None = None,
    workers: int = 1,
) -> float:
    """``resume --budget``: the job's cap set to ``budget``, its mark and its cancel cleared (in one
    transaction) when it had stopped at its budget.  InputError, naming ``--budget``, the job's spend now
    and the least budget to type (:func:`go_on`, for ``workers`` serving it), when the job has spent that
    much already (it would stop again at its next batch).  ``carried``: its spend before this Redis took it
    back (the store's record, for a job Redis lost; else the hash's ``budget_carried``).  The job's spend is
    counted at its pinned prices; one that has none (a job without a budget until now) pins ``prices``.
    Returns its spend now."""
    if why := budget_problem(budget):
        raise InputError([f"--budget: {why}"])
    prices = job_prices(client, job) or pinned(prices)
    if carried is None:
        carried = _number(client.hget(keys.job(job), CARRIED)) or 0.0
    now = spent_now(client, job, prices, carried)
    spent = now.spent
    if spent >= budget:
        raise InputError(
            [
                f"--budget {budget:g}: job {job} has spent {spent:.4g} already: give a budget above it; "
                + go_on(job, now, workers)
            ]
        )
    _, reached, _ = mark(client, job)
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.job(job), mapping={BUDGET: f"{budget:.6f}", CARRIED: f"{carried:.6f}", PRICES: json.dumps(prices)})
        if reached is not None:
            # Stopped by its budget alone: continued like a cancelled job (a cancel of the user's own,
            # had there been one, is cleared by the resume that called this, as for any resume).
            pipe.hdel(keys.job(job), REACHED, SPENT, "cancelled")
        pipe.execute()
    return spent


def check_resumable(client: redis.Redis, job: str, workers: Callable[[], int] = lambda: 1) -> None:
    """A plain ``resume`` (or resubmit) of a job stopped at its budget: InputError with its spend now (not
    the mark's: the batches in flight at the stop are counted after it) and the least budget to type
    (:func:`go_on`, for the ``workers()`` serving it: counted only for such a job)."""
    budget, reached, _ = mark(client, job)
    if reached is None or budget is None:
        return
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(reached))
    now = spent_now(client, job)
    raise InputError(
        [
            f"--budget: job {job} stopped at its budget of {budget:g} on {when} and has spent {now.spent:.4g} now: "
            f"{go_on(job, now, workers())}"
        ]
    )


# ---- the store's record ----------------------------------------------------------------------


# The store's record of a job's budget: its one definition is the schema it is read back through.
Record = schemas.Budget


def save(store: Store, job: str, record: Record) -> None:
    """The job's budget and its spend so far in the store (``spec.budget_key``)."""
    data = record.model_copy(update={"job": job, "budget": round(record.budget, 6), "spent": round(record.spent, 6)})
    store.put(spec.budget_key(job), data.model_dump_json().encode(), content_type="application/json")


def load(store: Store, job: str) -> Record | None:
    """The store's record of the job's budget; None without one.  A record that does not fit the
    schema (``renderfleet/schemas.py``) is one log line and taken as none: the job runs without a cap
    rather than not at all."""
    where = spec.budget_key(job)
    return schemas.read(Record, read_record(store, where, MAX_BUDGET_RECORD_BYTES), where)


def spent_already(record: Record) -> bool:
    """Whether the record says the job stopped at its budget (or spent it): it comes back stopped there."""
    return record.reached is not None or record.spent >= record.budget


def restore(client: redis.Redis, job: str, record: Record, at: str) -> bool:
    """A job registered again by a Redis that lost it (``dispatcher/jobs/resume.py``): its cap set again from the
    store's ``record`` and its spend then carried (``fence.lua`` counts it with what comes).  A record that
    says the cap is spent marks the job as the fence check would (reached at ``at``, cancelled): True then."""
    fields: dict[Any, Any] = {BUDGET: f"{record.budget:.6f}", CARRIED: f"{record.spent:.6f}"}
    if record.prices:
        fields[PRICES] = json.dumps(record.prices)
    if spent_already(record):
        client.hset(keys.job(job), mapping={**fields, REACHED: at, SPENT: fields[CARRIED], "cancelled": at})
        return True
    client.hset(keys.job(job), mapping=fields)
    return False


def record_due(budget: float, spent: float, reached: bool, last: float | None) -> bool:
    """Whether the monitor writes the store's record now (``spent``: the job's whole spend): on its first
    sight of the job, when the job stops at its budget, and once the spend has grown by a tenth of the budget
    since the last write: a Redis lost in between loses at most that tenth of the count."""
    if last is None:
        return True
    return (reached and spent != last) or spent - last >= budget / 10
