"""``renderfleet autoscale`` and ``scale``: the sizing policy applied to real pools.

Each tick reads the fleet from Redis (jobs, workers, the counters workers
keep), measures the backlog in seconds of work (:func:`backlog_seconds`),
asks the pure policy (:mod:`dispatcher.policy`) for each pool's
size and hands it to the pool's backend.  The ``local`` backend runs
``renderfleet worker`` processes on this machine; scale-in sends the chosen
worker SIGTERM, the spot hand-off (finish or abandon the batch in flight,
hand the shard back, exit 0), choosing idle workers first: never a kill.
When ``autoscale`` itself is stopped (Ctrl-C, SIGTERM, SIGHUP), the local
pools' workers on this machine are stopped the same way (:meth:`LocalBackend.stop_all`)
unless it was told to leave them (``--leave-workers``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import redis

from dispatcher.policy import Decision, PoolState, decide, recent_lost_fraction
from dispatcher.redisload import worker_room
from dispatcher.stagepools import stage_backlog
from dispatcher.status import FleetStatus, counter_hash, fleet_status, json_object, malformed, publish_prices
from renderfleet import keys
from renderfleet.embedded import private_dir
from renderfleet.errors import ConfigError
from renderfleet.leases import lua_script
from renderfleet.settings import PoolConfig, Settings
from renderfleet.spec import store_identity, store_tag
from renderfleet.store import Store

log = logging.getLogger("renderfleet.autoscale")


def _ratio(stats: dict[str, int], num: str, den: str) -> float | None:
    return stats[num] / stats[den] if stats.get(num) and stats.get(den) else None


# ---- backends ------------------------------------------------------------------------


class Backend(Protocol):
    """Who starts and stops one pool's workers."""

    def size(self, pool: str) -> int:
        """Workers asked for (running or starting)."""

    def set_size(self, pool: str, n: int) -> None: ...


def recent_counters(
    client: redis.Redis, pool: str, store: str, now: float, window_seconds: float
) -> dict[int, dict[str, int]]:
    """``pool``'s per-minute counters (keys.pool_recent) of ``store`` (a URL) covering the
    last ``window_seconds``, by minute."""
    step = keys.RECENT_BUCKET_SECONDS
    minutes = range(int((now - window_seconds) // step), int(now // step) + 1)
    tag = store_tag(store)
    pipe = client.pipeline(transaction=False)
    for minute in minutes:
        pipe.hgetall(keys.pool_recent(pool, minute, tag))
    return {
        minute: counter_hash(counts, keys.pool_recent(pool, minute, tag))
        for minute, counts in zip(minutes, pipe.execute(), strict=True)
        if counts
    }


def registered_workers(client: redis.Redis, pool: str, store: str) -> list[dict[str, Any]]:
    """The registrations of ``pool``'s live workers that write to ``store`` (a URL): another
    store's pool of the same name on a shared Redis is another pool."""
    ours = store_identity(store)
    out = []
    for worker_id, raw in client.hgetall(keys.WORKERS).items():
        # A registration that is not JSON, or whose pid is no number, is skipped (logged once): one
        # bad value in Redis must not stop the autoscaler.
        where = f"{keys.WORKERS} {worker_id!r}"
        info = json_object(raw, where)
        if info is None or info.get("pool") != pool or info.get("store") != ours:
            continue
        if "pid" in info and (type(info["pid"]) is not int or info["pid"] < 0):
            malformed(where, raw, "its pid is not a process id")
            continue
        out.append(info)
    return out


def busy_workers(client: redis.Redis) -> set[str]:
    """Workers holding a lease right now."""
    members = [keys.text(m) for m in client.zrange(keys.INFLIGHT, 0, -1)]
    pipe = client.pipeline(transaction=False)
    for m in members:
        pipe.hget(f"{keys.LEASE_PREFIX}{m}", "worker")
    return {keys.text(w) for w in pipe.execute() if w}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a child that exited and was not reaped yet answers kill 0: it is gone all the same
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill 0 must do


def _is_worker(pid: int) -> bool:
    """Whether ``pid`` runs ``renderfleet worker`` (where /proc can say): a registration's pid may
    have been reused by another process since, and that one must never be killed."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return False
    return any(a == b"renderfleet" or a.endswith(b"/renderfleet") for a in argv) and b"worker" in argv


class LocalBackend:
    """``renderfleet worker`` processes on this machine, one set per pool.

    Workers are found through their registrations in Redis (host and pid), so
    a ``renderfleet scale`` in one shell and an ``autoscale`` in another agree;
    only those of ``store`` (the URL its workers are started with, in ``env``).
    """

    def __init__(self, client: redis.Redis, *, store: str, env: dict[str, str], log_dir: Path, model: str | None = None):
        self.client = client
        self.store = store
        self.env = {**env, "RENDERFLEET_STORE": store}
        self.log_dir = log_dir
        self.model = model
        self.host = socket.gethostname()
        self._starting: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # every worker this backend started, by pid

    def _mine(self, pool: str) -> list[dict[str, Any]]:
        return [
            w
            for w in registered_workers(self.client, pool, self.store)
            if w.get("host") == self.host and _alive(int(w.get("pid", 0)))
        ]

    def _pending(self, pool: str) -> list[subprocess.Popen[bytes]]:
        registered = {int(w["pid"]) for w in registered_workers(self.client, pool, self.store)}
        alive = [p for p in self._starting.get(pool, []) if p.poll() is None and p.pid not in registered]
        self._starting[pool] = alive
        return alive

    def size(self, pool: str) -> int:
        return len(self._mine(pool)) + len(self._pending(pool))

    def ready(self, pool: str) -> int:
        return len(self._mine(pool))

    def set_size(self, pool: str, n: int) -> None:
        current = self.size(pool)
        for _ in range(n - current):
            self._start(pool)
        if n < current:
            self._stop(pool, current - n)

    def _start(self, pool: str) -> None:
        private_dir(self.log_dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_file = self.log_dir / f"worker-{pool}-{stamp}-{len(self._starting.get(pool, []))}.log"
        args = [sys.executable, "-m", "renderfleet", "worker", "--pool", pool]
        if self.model:
            args += ["--model", self.model]
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(
                args, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._starting.setdefault(pool, []).append(proc)
        self._children[proc.pid] = proc
        log.warning("pool %s: started a worker (pid %d)", pool, proc.pid)

    def _stop(self, pool: str, count: int) -> None:
        """SIGTERM ``count`` workers, idle ones first: the hand-off, never a kill."""
        busy = busy_workers(self.client)
        # Not yet registered: no shard yet, nothing to hand back.
        for proc in self._pending(pool)[:count]:
            proc.send_signal(signal.SIGTERM)
            count -= 1
        ranked = sorted(self._mine(pool), key=lambda w: (w["worker"] in busy, -float(w.get("started", 0))))
        for w in ranked[:count]:
            os.kill(int(w["pid"]), signal.SIGTERM)
            log.warning(
                "pool %s: stopping worker %s (%s)",
                pool,
                w["worker"],
                "busy: it hands its shard back" if w["worker"] in busy else "idle",
            )

    def stop_all(self, pools: list[str], timeout: float) -> tuple[int, int]:
        """Stop every worker of ``pools`` on this machine: SIGTERM (the hand-off), up to ``timeout``
        for all to leave, then SIGKILL what is left; (workers stopped, of which killed).

        Those started here and not registered yet, and those registered from this
        host (started by this backend, by ``scale`` in another shell, or by hand).
        """
        pids = {p.pid for pool in pools for p in self._pending(pool)}
        pids |= {int(w["pid"]) for pool in pools for w in self._mine(pool)}
        pids = {pid for pid in pids if pid in self._children or _is_worker(pid)}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        left = set(pids)
        while left and time.monotonic() < deadline:
            left = {pid for pid in left if self._running(pid)}
            time.sleep(0.2)
        left = {pid for pid in left if self._running(pid)}
        for pid in left:
            log.warning(
                "worker pid %d still there %.0f s after SIGTERM: killed (its lease expires, the reaper re-queues its shard)",
                pid,
                timeout,
            )
            with contextlib.suppress(ProcessLookupError):
                # Started here in a session of its own: the group is the worker and nothing else.
                if pid in self._children:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        for pid in left & self._children.keys():
            self._children[pid].wait(10)
        return len(pids), len(left)

    def _running(self, pid: int) -> bool:
        child = self._children.get(pid)
        return child.poll() is None if child is not None else _alive(pid)

    def close(self) -> None:
        """Reap children that have exited (they stop on their own after SIGTERM)."""
        for p in self._children.values():
            p.poll()


class AwsBackend:
    """Each pool is an EC2 Auto Scaling group; the autoscaler sets its desired capacity.

    AWS chooses which instance goes on scale-in: busy workers protect their
    instance (``worker/protection.py``), so the choice falls on idle ones.
    """

    def __init__(self, pools: dict[str, PoolConfig], client: Any = None):
        self.pools = pools
        self._clients: dict[str | None, Any] = {None: client} if client is not None else {}

    def _client(self, pool: str) -> Any:
        region = self.pools[pool].region
        if region not in self._clients and None not in self._clients:
            import boto3

            session = boto3.session.Session()
            self._clients[region] = session.client("autoscaling", region_name=region or session.region_name or "us-east-1")
        return self._clients.get(region) or self._clients[None]

    def _group(self, pool: str) -> dict[str, Any]:
        name = self.pools[pool].autoscaling_group
        found = self._client(pool).describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"]
        if not found:
            raise ConfigError(f"pools.{pool}.autoscaling_group = {name!r}: no such Auto Scaling group")
        return dict(found[0])

    def size(self, pool: str) -> int:
        return int(self._group(pool)["DesiredCapacity"])

    def set_size(self, pool: str, n: int) -> None:
        group = self._group(pool)
        n = max(int(group["MinSize"]), min(int(group["MaxSize"]), n))
        self._client(pool).set_desired_capacity(
            AutoScalingGroupName=group["AutoScalingGroupName"], DesiredCapacity=n, HonorCooldown=False
        )
        log.warning("pool %s: Auto Scaling group %s desired capacity %d", pool, group["AutoScalingGroupName"], n)


class PublishedBackend:
    """The ``keda`` backend: the decision is published (Redis, then the monitor's ``/api/autoscale``)
    and KEDA sets the Deployment's replicas to it (within its HPA's tolerance: docs/pools.md); the
    size is the workers up.  Both are ``store``'s: another store's pool of the same name on a
    shared Redis is another pool."""

    def __init__(self, client: redis.Redis, store: str):
        self.client = client
        self.store = store

    def size(self, pool: str) -> int:
        return len(registered_workers(self.client, pool, self.store))

    def set_size(self, pool: str, n: int) -> None:
        self.client.hset(keys.desired(store_tag(self.store)), pool, n)


# ---- the loop ---------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """One pass of the autoscaler: what it saw and what it decided."""

    at: float
    backlog_seconds: float
    seconds_per_mpstep: float
    jobs: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    # What the policy was told of each pool: sizes, measured speed, recent reclaim loss, cold start.
    pools: list[dict[str, Any]]
    # The backlog of each pool that runs a stage of its own (dispatcher/stagepools.py), sized by it alone.
    stage_pools: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Starting a worker process before its model loads (interpreter, imports, Redis).
PROCESS_START_SECONDS = 5.0


class Autoscaler:
    """Applies the policy to every configured pool through its backend."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        store: Store,
        backends: dict[str, Backend],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.settings = settings
        self.client = client
        self.store = store
        self.backends = backends
        self.clock = clock
        self.wall_clock = wall_clock  # the workers' minutes of recent counters are unix time
        self.last_change: dict[str, float] = {}
        self.pending_since: dict[str, float] = {}

    def _state(
        self, name: str, cfg: PoolConfig, stats: dict[str, dict[str, int]], spmps: float, now: float, fleet: FleetStatus
    ) -> PoolState:
        backend = self.backends[name]
        current = backend.size(name)
        ready = fleet.pool_sizes().get(name, 0)
        if ready < current:
            self.pending_since.setdefault(name, now)
        else:
            self.pending_since.pop(name, None)
        mine = stats.get(name, {})
        own = _ratio(mine, "render_ms", "mps_milli")
        window = self.settings.autoscale.reclaim_window_seconds
        wall = self.wall_clock()
        lost = recent_lost_fraction(
            recent_counters(self.client, name, self.store.url, wall, window), wall, window, keys.RECENT_BUCKET_SECONDS
        )
        # A worker's cold start: its model load (measured) plus starting the process.
        load_ms = [int(w.get("load_ms", 0)) for w in fleet.workers if w.get("pool") == name]
        cold = (sum(load_ms) / len(load_ms) / 1000 + PROCESS_START_SECONDS) if any(load_ms) else None
        return PoolState(
            name,
            cfg,
            current=current,
            ready=ready,
            speed=spmps / own if own else 1.0,
            lost_fraction=lost,
            cold_start_seconds=cold,
            last_change=self.last_change.get(name),
            pending_since=self.pending_since.get(name),
        )

    def tick(self, *, dry_run: bool = False) -> Tick:
        now = self.clock()
        fleet = fleet_status(self.client, store=self.store)
        stats, spmps, backlog = fleet.pools, fleet.seconds_per_mpstep, fleet.backlog_seconds
        spent = self.month_spend(fleet, count=not dry_run)
        states = [
            replace(self._state(n, c, stats, spmps, now, fleet), month_spend=spent.get(n, 0.0))
            for n, c in self.settings.pools.items()
        ]
        # A pool that runs a stage of its own is sized by that stage's backlog alone (dispatcher/stagepools.py);
        # the rest of the backlog by the other pools, as before.
        staged = stage_backlog(self.client, fleet.jobs, spmps)
        backlog = max(0.0, backlog - staged.taken)
        room = worker_room(fleet.redis)
        decisions = decide(
            backlog, [p for p in states if p.name not in staged.seconds], self.settings.autoscale, now, redis_room=room
        )
        for p in states:
            if p.name in staged.seconds:
                decisions += decide(staged.seconds[p.name], [p], self.settings.autoscale, now, redis_room=room)
        if not dry_run:
            for d in decisions:
                if d.change:
                    self.backends[d.pool].set_size(d.pool, d.desired)
                    self.last_change[d.pool] = now
                    log.warning("pool %s: %d -> %d: %s", d.pool, d.current, d.desired, d.reason)
            self._publish(decisions)
        jobs = [{"job": j.job, "left": j.to_render, "backlog_seconds": round(j.backlog_seconds, 3)} for j in fleet.jobs]
        return Tick(
            time.time(),
            backlog,
            spmps,
            jobs,
            [_decision(d) for d in decisions],
            [_inputs(p, self.settings.autoscale.cold_start_seconds) for p in states],
            {pool: round(sec, 3) for pool, sec in sorted(staged.seconds.items())},
        )

    def month_spend(self, fleet: FleetStatus, *, count: bool = True) -> dict[str, float]:
        """Each priced pool's spend this calendar month (UTC): its workers up since the last tick, at
        its price per hour, added to the month's count in Redis (``count``; a dry run only reads it),
        a gap of more than two ticks counted as two (``renderfleet/lua/pool_spend.lua``).  What policy
        rule 8 holds against a pool's ``monthly_budget``."""
        month = time.strftime("%Y-%m", time.gmtime(self.wall_clock()))
        key = keys.pool_month(store_tag(self.store.url), month)
        priced = {name: cfg.price_per_hour for name, cfg in self.settings.pools.items() if cfg.price_per_hour > 0}
        if not priced:
            return {}
        if not count:
            raw = self.client.hmget(key, *(f"usd.{name}" for name in priced))
            return {name: float(keys.text(v) or 0) for name, v in zip(priced, raw, strict=True)}
        script = self.client.register_script(lua_script("pool_spend"))
        up = fleet.pool_sizes()
        gap_ms = int(2 * self.settings.autoscale.interval_seconds * 1000)
        return {
            name: float(
                keys.text(script(keys=[key], args=[name, up.get(name, 0), price, gap_ms, keys.POOL_MONTH_KEEP_SECONDS]))
            )
            for name, price in priced.items()
        }

    def _publish(self, decisions: list[Decision]) -> None:
        """What was decided, and each pool's price, for status and the metrics endpoint."""
        self.client.hset(keys.desired(store_tag(self.store.url)), mapping={d.pool: d.desired for d in decisions} or {"": 0})
        publish_prices(self.client, self.store.url, {n: p.price_per_hour for n, p in self.settings.pools.items()})

    def run_forever(self) -> None:
        while True:
            try:
                self.tick()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("autoscale: Redis unavailable: %s", exc)
            time.sleep(self.settings.autoscale.interval_seconds)


def _inputs(p: PoolState, default_cold_start: float) -> dict[str, Any]:
    return {
        "pool": p.name,
        "current": p.current,
        "ready": p.ready,
        "speed": round(p.speed, 3),
        "lost_fraction": round(p.lost_fraction, 3),
        "cold_start_seconds": round(p.cold_start_seconds or default_cold_start, 1),
        "cold_start_measured": p.cold_start_seconds is not None,
        "month_spend": round(p.month_spend, 4),
    }


def _decision(d: Decision) -> dict[str, Any]:
    return {"pool": d.pool, "current": d.current, "desired": d.desired, "reason": d.reason}
