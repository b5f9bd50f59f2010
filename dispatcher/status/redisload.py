"""What the fleet costs its Redis, read where the fleet's figures are read (status, the page, /metrics).

One Redis carries the whole fleet, and three of its limits stop it before
anything else does (docs/deployment.md, "How many workers one Redis carries"):

- **its main thread's CPU**: the thread that runs every command and script.
  Past about 80 % of a core the fleet's round trips queue, and every batch,
  heartbeat and claim waits (bench/redis_scale.py measured 70 to 90 µs of it a
  second per busy worker);
- **maxclients**: each worker holds about five connections (kombu's consumer
  and its channel, the lease keeper's, a commit lane's, the stats writer's);
  Redis refuses the next one past ``maxclients`` (10,000 by default: about
  2,000 workers);
- **maxmemory**, where one is set: a connection's buffers count towards it
  (about 32 KB each as Redis accounts them), and with ``noeviction`` a full
  Redis refuses writes.

Redis gives its CPU time as a running total, so a share of a core needs two
readings: the last two are kept in Redis itself (:data:`renderfleet.keys.REDIS_LOAD`,
timed by Redis's own clock), so any reader (``renderfleet status`` once, the
monitor's scrapes and samples every few seconds) gets the share over the last
few seconds without keeping anything in its own process.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import redis

from renderfleet import keys

log = logging.getLogger(__name__)

BUSY = 0.8  # past this share of a core, of maxclients or of maxmemory, status and the page warn
CONNECTIONS_PER_WORKER = 5  # kombu's two, and redis-py's for the lease keeper, a commit lane, the stats writer
CONNECTION_BYTES = 32 * 1024  # what Redis 7 counts a connection's buffers as, against maxmemory
KEEP_SECONDS = 5.0  # a reading is kept when the last kept one is at least this old
MIN_WINDOW = 1.0  # a share over less than this many seconds is not given (noise)
MAX_WINDOW = 900.0  # nor over more (an average that old says little of now)
WHERE = 'docs/deployment.md, "How many workers one Redis carries"'


@dataclass
class RedisLoad:
    """Redis's own figures (``INFO``), and its CPU share of one core over the last few seconds."""

    cpu_seconds: float  # its main thread's CPU time since it started (user and system)
    commands: int  # commands processed since it started
    clients: int
    maxclients: int
    used_memory: int  # bytes, as Redis accounts them (maxmemory compares this)
    maxmemory: int  # 0: none set
    ops_per_second: int  # Redis's own recent figure
    cpu_share: float | None = None  # of one core, over cpu_window seconds; None until two readings are apart
    cpu_window: float | None = None

    def limits(self) -> list[tuple[int | None, bool, str]]:
        """Each limit this Redis told of: (workers more it takes before the limit passes :data:`BUSY`, None
        where that is no count; whether it is past :data:`BUSY` now; the limit in words).  Its main thread
        has no count: past :data:`BUSY`, none (more workers would slow every one).  Clients and memory: what
        is left under :data:`BUSY` of ``maxclients`` and ``maxmemory``, at :data:`CONNECTIONS_PER_WORKER`
        connections a worker."""
        out: list[tuple[int | None, bool, str]] = []
        if self.cpu_share is not None:
            past = self.cpu_share >= BUSY
            out.append(
                (
                    0 if past else None,
                    past,
                    f"Redis's main thread is at {self.cpu_share:.0%} of a core: "
                    f"past {BUSY:.0%} the fleet's round trips queue, and a worker more slows every one",
                )
            )
        if self.maxclients:
            room = int((BUSY * self.maxclients - self.clients) // CONNECTIONS_PER_WORKER)
            out.append(
                (
                    max(0, room),
                    self.clients >= BUSY * self.maxclients,
                    f"Redis has {self.clients:,} of its {self.maxclients:,} clients, about "
                    f"{CONNECTIONS_PER_WORKER} a worker: past maxclients the next worker is refused",
                )
            )
        if self.maxmemory:
            room = int((BUSY * self.maxmemory - self.used_memory) // (CONNECTIONS_PER_WORKER * CONNECTION_BYTES))
            out.append(
                (
                    max(0, room),
                    self.used_memory >= BUSY * self.maxmemory,
                    f"Redis uses {self.used_memory / 2**20:,.0f} MiB of its maxmemory "
                    f"{self.maxmemory / 2**20:,.0f} MiB: when full it refuses writes",
                )
            )
        return out

    def warnings(self) -> list[str]:
        """One line for each limit the fleet is near (past :data:`BUSY`)."""
        return [f"{what} ({WHERE})" for _, past, what in self.limits() if past]

    def summary(self) -> str:
        """One line: the share of a core, clients, commands a second, memory."""
        cpu = (
            f"{self.cpu_share:.0%} of a core (last {self.cpu_window:.0f} s)"
            if self.cpu_share is not None and self.cpu_window is not None
            else "CPU share not known yet"
        )
        limit = f"{self.maxmemory / 2**20:,.0f} MiB" if self.maxmemory else "no maxmemory"
        return (
            f"redis: {cpu}, {self.clients:,} of {self.maxclients:,} clients, {self.ops_per_second:,} commands/s, "
            f"{self.used_memory / 2**20:,.0f} MiB used ({limit})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_seconds": round(self.cpu_seconds, 3),
            "cpu_share": None if self.cpu_share is None else round(self.cpu_share, 4),
            "cpu_window_seconds": None if self.cpu_window is None else round(self.cpu_window, 3),
            "commands": self.commands,
            "clients": self.clients,
            "maxclients": self.maxclients,
            "used_memory": self.used_memory,
            "maxmemory": self.maxmemory,
            "ops_per_second": self.ops_per_second,
            "warnings": self.warnings(),
        }


def main_thread_cpu(info: dict[str, Any]) -> float:
    """The CPU seconds of the thread that runs the commands: ``used_cpu_*_main_thread`` (Redis 7), else the
    process's (the same thing where io-threads are off)."""
    if "used_cpu_sys_main_thread" in info:
        return float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"])
    return float(info.get("used_cpu_sys", 0.0)) + float(info.get("used_cpu_user", 0.0))


def _reading(raw: dict[Any, Any], prefix: str) -> tuple[float, float, str] | None:
    """A kept reading (time, cpu, run id) from the hash, or None if absent or malformed."""
    try:  # written by anyone: a field not text, or not a number, is no reading
        fields = {keys.text(k): keys.text(v) for k, v in raw.items()}
        return float(fields[f"{prefix}t"]), float(fields[f"{prefix}cpu"]), fields[f"{prefix}run"]
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


def share(now: float, cpu: float, run: str, kept: list[tuple[float, float, str] | None]) -> tuple[float, float] | None:
    """(share of a core, window in seconds) against the newest kept reading at least :data:`MIN_WINDOW` old,
    of the same Redis run (a restart starts its CPU time again), or None."""
    for reading in kept:
        if reading is None:
            continue
        t, c, r = reading
        window = now - t
        if r == run and MIN_WINDOW <= window <= MAX_WINDOW and cpu >= c:
            return (cpu - c) / window, window
    return None


def redis_load(client: redis.Redis) -> RedisLoad | None:
    """Redis's figures now (one round trip: TIME, INFO and the kept readings; a second, every
    :data:`KEEP_SECONDS` at most, to keep this one).  None where Redis refuses INFO or TIME (a managed
    Redis may rename them)."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.info()
    pipe.hgetall(keys.REDIS_LOAD)
    try:
        (secs, micros), info, raw = pipe.execute()
        now = float(secs) + float(micros) / 1e6
        cpu = main_thread_cpu(info)
        load = RedisLoad(
            cpu_seconds=cpu,
            commands=int(info.get("total_commands_processed", 0)),
            clients=int(info.get("connected_clients", 0)),
            maxclients=_maxclients(client, info),
            used_memory=int(info.get("used_memory", 0)),
            maxmemory=int(info.get("maxmemory", 0)),
            ops_per_second=int(info.get("instantaneous_ops_per_sec", 0)),
        )
    except redis.ResponseError:
        return None
    except (TypeError, ValueError, AttributeError) as exc:  # a Redis-like server whose INFO says otherwise
        log.warning("Redis's INFO not understood, its load not shown: %s", exc)
        return None
    run = str(info.get("run_id", ""))
    last, before = _reading(raw, ""), _reading(raw, "prev_")
    found = share(now, cpu, run, [last, before])
    if last is None or last[2] != run or now - last[0] >= KEEP_SECONDS or now < last[0]:
        mapping: dict[Any, Any] = {"t": f"{now:.6f}", "cpu": f"{cpu:.6f}", "run": run}
        if last is not None and last[2] == run and now > last[0]:
            mapping.update(prev_t=f"{last[0]:.6f}", prev_cpu=f"{last[1]:.6f}", prev_run=last[2])
        # On a replica, as a user allowed to read only, or on a primary being demoted (Sentinel's client
        # reports READONLY as a ConnectionError), nothing is kept: the share waits for the next writer.
        with contextlib.suppress(redis.RedisError):
            client.hset(keys.REDIS_LOAD, mapping=mapping)
    if found:
        load.cpu_share, load.cpu_window = found
    return load


def _maxclients(client: redis.Redis, info: dict[str, Any]) -> int:
    """``maxclients`` from INFO (Redis 7), else from CONFIG GET (older; 0 where that is refused)."""
    if "maxclients" in info:
        return int(info["maxclients"])
    try:
        return int(client.config_get("maxclients").get("maxclients") or 0)
    except (redis.ResponseError, ValueError, TypeError):
        return 0


def worker_room(load: RedisLoad | None) -> tuple[int, str] | None:
    """How many workers more this Redis takes before one of its limits passes :data:`BUSY`, and which
    limit (the autoscaler's rule 7, dispatcher/fleet/policy.py); None where no limit is known.  A Redis shared
    by several stores' autoscalers is counted by each: a bound for each, not shared out."""
    counted = [(room, what) for room, _, what in (load.limits() if load else []) if room is not None]
    return min(counted) if counted else None
