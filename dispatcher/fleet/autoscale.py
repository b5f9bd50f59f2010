"""``renderfleet autoscale`` and ``scale``: the sizing policy applied to real pools.

Each tick reads the fleet from Redis (jobs, workers, the counters workers
keep), measures the backlog in seconds of work (:func:`backlog_seconds`),
asks the pure policy (:mod:`dispatcher.fleet.policy`) for each pool's
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
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import redis

from dispatcher.fleet.policy import (
    CARD,
    POOL,
    Decision,
    NodeDecision,
    PoolState,
    decide,
    over_month,
    recent_lost_fraction,
    to_nodes,
)
from dispatcher.fleet.stagepools import stage_backlog
from dispatcher.fleet.stagepools import stage_only as stage_only_pools
from dispatcher.jobs.prices import publish_prices
from dispatcher.status.redisload import worker_room
from dispatcher.status.status import (
    FleetStatus,
    counter_hash,
    fleet_status,
    json_object,
    malformed,
    publish_gpus_per_node,
)
from renderfleet import cards, keys, registry, speeds
from renderfleet.embedded import private_dir
from renderfleet.errors import ConfigError
from renderfleet.leases import lua_script
from renderfleet.nodes import NodeState, read_nodes
from renderfleet.settings import PoolConfig, Settings
from renderfleet.spec import JobSpec, store_identity, store_tag
from renderfleet.store import Store

log = logging.getLogger("renderfleet.autoscale")

# A node record whose supervisor still runs its workers (or drains them): a node of the pool.
_NODE_LIVE = (NodeState.RUNNING, NodeState.DRAINING)


def _ratio(stats: dict[str, int], num: str, den: str) -> float | None:
    return stats[num] / stats[den] if stats.get(num) and stats.get(den) else None


# ---- backends ------------------------------------------------------------------------


class Backend(Protocol):
    """Who starts and stops one pool's nodes (a node: ``gpus_per_node`` GPUs, a worker each)."""

    def size(self, pool: str) -> int:
        """Nodes asked for (running or starting): instances, pods, node supervisors; workers where a
        node has one GPU."""

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
    for worker_id, raw in registry.live_registrations(client).items():
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
    A pool of nodes of several GPUs (``gpus_per_node`` in ``pools``) is sized in
    nodes: one ``renderfleet worker --gpus N`` node supervisor each, found through
    its node record (``renderfleet/nodes.py``: host and pid), stopped whole.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        store: str,
        env: dict[str, str],
        log_dir: Path,
        model: str | None = None,
        pools: Mapping[str, PoolConfig] | None = None,
    ):
        self.client = client
        self.store = store
        self.env = {**env, "RENDERFLEET_STORE": store}
        self.log_dir = log_dir
        self.model = model
        self.per_node = {name: cfg.gpus_per_node for name, cfg in (pools or {}).items()}
        self.host = socket.gethostname()
        self._starting: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # every worker this backend started, by pid

    def _nodes(self, pool: str) -> bool:
        return self.per_node.get(pool, 1) > 1

    def _mine(self, pool: str) -> list[dict[str, Any]]:
        """The pool's live workers on this machine; a node pool's: its live node supervisors' records
        (``pid`` the supervisor's)."""
        if self._nodes(pool):
            return [
                {"worker": n.node, "pid": n.pid, "node": n.node}
                for n in read_nodes(self.client, store_identity(self.store))
                if n.pool == pool and n.host == self.host and n.pid and _alive(n.pid) and n.state in _NODE_LIVE
            ]
        return [
            w
            for w in registered_workers(self.client, pool, self.store)
            if w.get("host") == self.host and _alive(int(w.get("pid", 0)))
        ]

    def _pending(self, pool: str) -> list[subprocess.Popen[bytes]]:
        if self._nodes(pool):
            registered = {int(w["pid"]) for w in self._mine(pool)}
        else:
            registered = {int(w["pid"]) for w in registered_workers(self.client, pool, self.store)}
        alive = [p for p in self._starting.get(pool, []) if p.poll() is None and p.pid not in registered]
        self._starting[pool] = alive
        return alive

    def size(self, pool: str) -> int:
        """Workers asked for; a node pool's nodes (supervisors)."""
        return len(self._mine(pool)) + len(self._pending(pool))

    def ready(self, pool: str) -> int:
        return len(self._mine(pool))

    def start_args(self, pool: str) -> list[str]:
        """``renderfleet worker``'s flags for one of ``pool``'s workers, or one node supervisor of its GPUs."""
        args = ["--pool", pool] + (["--model", self.model] if self.model else [])
        return args + (["--gpus", str(self.per_node[pool])] if self._nodes(pool) else [])

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
        args = [sys.executable, "-m", "renderfleet", "worker", *self.start_args(pool)]
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(
                args, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._starting.setdefault(pool, []).append(proc)
        self._children[proc.pid] = proc
        log.warning("pool %s: started a %s (pid %d)", pool, "node" if self._nodes(pool) else "worker", proc.pid)

    def _stop(self, pool: str, count: int) -> None:
        """SIGTERM ``count`` workers (nodes), idle ones first: the hand-off, never a kill."""
        busy = busy_workers(self.client)
        if self._nodes(pool):  # a node is busy while any of its workers is
            busy = {str(w.get("node")) for w in registered_workers(self.client, pool, self.store) if w["worker"] in busy}
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
        pids |= {int(w["pid"]) for pool in pools for w in self._mine(pool)}  # a node's supervisor, not its workers
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
    instance (``worker/node/protection.py``), so the choice falls on idle ones.
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

    def __init__(self, client: redis.Redis, store: str, pools: Mapping[str, PoolConfig] | None = None):
        self.client = client
        self.store = store
        self.per_node = {name: cfg.gpus_per_node for name, cfg in (pools or {}).items()}

    def size(self, pool: str) -> int:
        """Pods up: the distinct nodes of the pool's workers (a worker on its own is one)."""
        return len({str(w.get("node") or w["worker"]) for w in registered_workers(self.client, pool, self.store)})

    def set_size(self, pool: str, n: int) -> None:
        # Published in GPUs, as the autoscaler publishes every decision; /api/autoscale answers in pods.
        self.client.hset(keys.desired(store_tag(self.store)), pool, n * self.per_node.get(pool, 1))


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
    # The backlog of each pool that runs a stage of its own (dispatcher/fleet/stagepools.py), sized by it alone.
    stage_pools: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Starting a worker process before its model loads (interpreter, imports, Redis).
PROCESS_START_SECONDS = 5.0
# How long a model's speed records (renderfleet/speeds.py) are used before they are read again: a worker
# writes a key at most every speeds.WRITE_SECONDS, and a tick comes every few seconds.
SPEEDS_READ_SECONDS = 60.0


@dataclass(frozen=True)
class BacklogKind:
    """The kind of image most of the backlog is (policy rule 10): the job with the most seconds of work left."""

    spec: JobSpec
    work_seconds_per_image: float  # one image's work on the reference worker (the backlog's unit)

    def wanted(self, card: str) -> speeds.Wanted:
        p = self.spec.params
        return speeds.Wanted(
            speeds.SpeedKey(p.model, p.revision, p.width, p.height, p.steps, tuple(p.stages), card, self.spec.batch_size)
        )

    def describe(self) -> str:
        """``sd-turbo 512x512, 4 steps, batch 4``."""
        return f"{self.spec.params.model} {self.wanted('').key.describe()}"


def pool_card(cfg: PoolConfig, workers: list[dict[str, Any]], pool: str) -> str:
    """A pool's card: the config's ``card``, else the one most of its live workers report ('' unknown)."""
    if cfg.card:
        return cfg.card
    named = [str(w.get("card")) for w in workers if w.get("pool") == pool and w.get("card")]
    return max(set(named), key=named.count) if named else ""


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
        self.nodes: dict[str, int] = {}  # each pool's nodes asked for, as its backend said this tick
        self._speeds: dict[str, tuple[float, list[speeds.SpeedRecord]]] = {}  # model -> (read at, its records)

    def backlog_kind(self, fleet: FleetStatus) -> BacklogKind | None:
        """Policy rule 10's kind of image: the job with the most work left (its registration in Redis); None
        with no backlog or a registration that cannot be read."""
        left = [j for j in fleet.jobs if j.to_render and j.backlog_seconds > 0]
        if not left:
            return None
        top = max(left, key=lambda j: j.backlog_seconds)
        try:
            spec = JobSpec.from_json(self.client.hget(keys.job(top.job), "spec") or b"")
        except (ValueError, KeyError, TypeError):
            return None
        return BacklogKind(spec, top.backlog_seconds / top.to_render)

    def needs(self, fleet: FleetStatus) -> dict[float, float]:
        """Policy rule 11: seconds of work left by the card memory (GB) its jobs need (``keys.job``'s
        ``min_vram``, one pipelined read); the jobs that need none left out."""
        left = [j for j in fleet.jobs if j.backlog_seconds > 0]
        if not left:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for j in left:
            pipe.hget(keys.job(j.job), cards.FIELD)
        out: dict[float, float] = {}
        for j, raw in zip(left, pipe.execute(), strict=True):
            if (gb := cards.read_min_vram(raw)) > 0:
                out[gb] = out.get(gb, 0.0) + j.backlog_seconds
        return out

    def records(self, model: str) -> list[speeds.SpeedRecord]:
        """``model``'s speed records, read from the store at most every :data:`SPEEDS_READ_SECONDS`;
        a store that cannot answer leaves the last ones read (none: nothing measured)."""
        now = self.clock()
        at, records = self._speeds.get(model, (-math.inf, []))
        if now - at >= SPEEDS_READ_SECONDS:
            try:
                records = speeds.records_of(self.store, model)
            except Exception as exc:  # the store's trouble is no reason to stop sizing pools
                log.warning("autoscale: speed records of %s not read: %s: %s", model, type(exc).__name__, exc)
            self._speeds[model] = (now, records)
        return records

    def _card_speed(self, state: PoolState, kind: BacklogKind | None, fleet: FleetStatus) -> PoolState:
        """Policy rule 10: ``state`` with its speed measured on its card for the backlog's kind of image, if the
        store has that record; else as its counters had it."""
        card = pool_card(state.config, fleet.workers, state.name)
        memory = cards.pool_vram(state.config.vram_gib, [w for w in fleet.workers if w.get("pool") == state.name])
        state = replace(state, card=card, vram_gib=memory)  # policy rule 11: which --min-vram work it takes
        if kind is None or not card:
            return state
        found = speeds.speed_for(self.records(kind.spec.params.model), kind.wanted(card))
        if found.basis != speeds.MEASURED:
            return state
        return replace(
            state,
            speed=kind.work_seconds_per_image / found.seconds_per_image,
            measured=CARD,
            seconds_per_image=found.seconds_per_image,
            routed_for=kind.describe(),
        )

    def _state(
        self, name: str, cfg: PoolConfig, stats: dict[str, dict[str, int]], spmps: float, now: float, fleet: FleetStatus
    ) -> PoolState:
        backend = self.backends[name]
        self.nodes[name] = backend.size(name)
        current = self.nodes[name] * cfg.gpus_per_node  # policy rule 9: decided in GPUs
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
            measured=POOL if own else "",
        )

    def tick(self, *, dry_run: bool = False) -> Tick:
        now = self.clock()
        fleet = fleet_status(self.client, store=self.store)
        stats, spmps, backlog = fleet.pools, fleet.seconds_per_mpstep, fleet.backlog_seconds
        spent = self.month_spend(fleet, count=not dry_run)
        kind = self.backlog_kind(fleet)
        states = [
            replace(
                self._card_speed(self._state(n, c, stats, spmps, now, fleet), kind, fleet), month_spend=spent.get(n, 0.0)
            )
            for n, c in self.settings.pools.items()
        ]
        # A pool that runs a stage of its own is sized by that stage's backlog alone (dispatcher/fleet/stagepools.py,
        # unless it is some job's own pool too); the rest of the backlog by the other pools, as before.
        stage_only, theirs = stage_only_pools(stage_backlog(self.client, fleet.jobs, spmps), fleet.jobs)
        backlog = max(0.0, backlog - theirs)
        room = worker_room(fleet.redis)
        decisions = decide(
            backlog,
            [p for p in states if p.name not in stage_only],
            self.settings.autoscale,
            now,
            redis_room=room,
            needs=self.needs(fleet),
        )
        for p in states:
            if p.name in stage_only:
                decisions += decide(stage_only[p.name], [p], self.settings.autoscale, now, redis_room=room)
        busy = busy_nodes(fleet.workers, busy_workers(self.client))
        capped = {p.name for p in states if over_month(p) is not None}
        in_nodes = [
            to_nodes(d, self.settings.pools[d.pool], self.nodes[d.pool], busy.get(d.pool, 0), capped=d.pool in capped)
            for d in decisions
        ]
        if not dry_run:
            for nd in in_nodes:
                if nd.change:
                    self.backends[nd.pool].set_size(nd.pool, nd.desired)
                    self.last_change[nd.pool] = now
                    log.warning("pool %s: %d -> %d: %s", nd.pool, nd.current, nd.desired, nd.reason)
            self._publish(in_nodes)
        jobs = [{"job": j.job, "left": j.to_render, "backlog_seconds": round(j.backlog_seconds, 3)} for j in fleet.jobs]
        return Tick(
            time.time(),
            backlog,
            spmps,
            jobs,
            [_decision(d, nd, self.settings.pools[d.pool].gpus_per_node) for d, nd in zip(decisions, in_nodes, strict=True)],
            [_inputs(p, self.settings.autoscale.cold_start_seconds) for p in states],
            {pool: round(sec, 3) for pool, sec in sorted(stage_only.items())},
        )

    def month_spend(self, fleet: FleetStatus, *, count: bool = True) -> dict[str, float]:
        """Each priced pool's spend this calendar month (UTC): its workers up since the last tick, at
        its price per hour, added to the month's count in Redis (``count``; a dry run only reads it),
        a gap of more than two ticks counted as two (``renderfleet/lua/pool_spend.lua``).  What policy
        rule 8 holds against a pool's ``monthly_budget``."""
        month = time.strftime("%Y-%m", time.gmtime(self.wall_clock()))
        key = keys.pool_month(store_tag(self.store.url), month)
        priced = {name: p for name, p in self.settings.gpu_prices.items() if p > 0}
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

    def _publish(self, decisions: list[NodeDecision]) -> None:
        """What was decided (in GPUs: the nodes asked for times their GPUs), each pool's GPUs per node
        and price per GPU-hour, for status, KEDA (``/api/autoscale``) and the metrics endpoint."""
        self.client.hset(keys.desired(store_tag(self.store.url)), mapping={d.pool: d.gpus for d in decisions} or {"": 0})
        publish_prices(self.client, self.store.url, self.settings.gpu_prices)
        publish_gpus_per_node(self.client, self.store.url, {n: p.gpus_per_node for n, p in self.settings.pools.items()})

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
        "card": p.card,
        "vram_gib": p.vram_gib,  # its card's memory (policy rule 11); None unknown: it takes no --min-vram work
        "measured": p.measured,  # what its speed rests on (policy rule 10): card, pool or '' (nothing)
        "seconds_per_image": p.seconds_per_image,
    }


def _decision(d: Decision, nd: NodeDecision, gpus_per_node: int) -> dict[str, Any]:
    """A decision in GPUs (workers: ``current``, ``desired``, what is asked of the backend) and nodes."""
    return {
        "pool": d.pool,
        "current": d.current,
        "desired": nd.gpus,
        "current_nodes": nd.current,
        "nodes": nd.desired,
        "gpus_per_node": gpus_per_node,
        "reason": nd.reason,
    }


def busy_nodes(workers: list[dict[str, Any]], busy: set[str]) -> dict[str, int]:
    """Each pool's nodes with work in flight: a worker of ``busy`` (holding a lease) makes its node
    busy (its registration's ``node``, worker/lease/service.py ``node_fields``; a worker on its own is its node)."""
    nodes: dict[str, set[str]] = {}
    for w in workers:
        if w.get("worker") in busy:
            nodes.setdefault(str(w.get("pool")), set()).add(str(w.get("node") or w.get("worker")))
    return {pool: len(ids) for pool, ids in nodes.items()}
