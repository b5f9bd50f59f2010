"""One settings object per process, from flags and the environment.

Few settings, lowercase, each commented (Celery's ~200 settings with two
naming schemes is the cautionary tale).  Every environment variable is
``RENDERFLEET_<NAME>``; the standard ``AWS_*`` variables (``AWS_ENDPOINT_URL``
included) are read by boto3 itself.  Validation happens once, at start-up,
and a bad value is reported by name (:func:`load_settings`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from renderfleet.core.errors import ConfigError

_POOL_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")


def _default_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "renderfleet"


class Settings(BaseSettings):
    """Everything a renderfleet process can be told."""

    model_config = SettingsConfigDict(env_prefix="RENDERFLEET_", extra="ignore", frozen=True)

    # Broker and fleet state.  None: use (or start) the embedded local server.
    redis_url: str | None = None
    # Where images, checkpoints and specs go: s3://bucket/prefix or a folder.
    # None: the folder ./renderfleet-output.
    store: str | None = None
    # The model a worker loads at start-up and submit's default.
    model: str = "tiny"
    # Where the embedded server, the model cache and local state live.
    home: Path = Field(default_factory=_default_home)
    # Which pool this worker belongs to (baseline, spot, ...): its queue and its metrics label.
    pool: str = "default"
    # Poll cloud metadata for reclaim notices: auto = when the pool name contains "spot".
    reclaim_watch: str = "auto"
    aws_metadata_url: str = "http://169.254.169.254"
    gcp_metadata_url: str = "http://metadata.google.internal"
    # How often the watcher polls the metadata services, in seconds.
    reclaim_poll_seconds: float = 1.0
    # After SIGTERM, how long a batch in flight may take to finish (Kubernetes gives 30 s).
    sigterm_grace_seconds: float = 25.0
    # A shard whose lease is older than this is taken to be lost and re-queued.
    lease_seconds: float = 6.0
    # How often a running shard renews its lease (must be well under lease_seconds).
    heartbeat_seconds: float = 1.5
    # How often every worker (and the monitor) looks for expired leases.
    reap_seconds: float = 1.0
    # How often the monitor audits queued shards for a message lost between a queue and
    # a claim (a worker gone after taking it); one lost is re-queued within two audits.
    audit_seconds: float = 30.0
    # A prompt that fails this many times is quarantined.
    max_prompt_failures: int = 3
    # A worker whose last this-many shards all failed stops taking work.
    breaker_shards: int = 2
    # One pipeline call per prompt instead of per batch: identical bytes across
    # batch sizes, at a large cost in throughput (see worker/render.py).
    batch_invariant: bool = False
    # Device override for workers (cuda, cpu, mps); None: best available.
    device: str | None = None

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        scheme = urlparse(value).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"must start with redis://, rediss:// or unix://, got {value!r}")
        if scheme == "rediss" and "ssl_cert_reqs" not in value:
            # kombu refuses rediss:// without it; verifying the server is the safe default.
            value += ("&" if "?" in value else "?") + "ssl_cert_reqs=required"
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if value.startswith("s3://") and not value[5:].split("/", 1)[0]:
            raise ValueError(f"s3 URL needs a bucket: {value!r}")
        return value

    @field_validator("pool")
    @classmethod
    def _check_pool(cls, value: str) -> str:
        if not _POOL_RE.match(value):
            raise ValueError(f"pool names are lowercase letters, digits, - and _: {value!r}")
        return value

    @field_validator("reclaim_watch")
    @classmethod
    def _check_watch(cls, value: str) -> str:
        if value not in ("auto", "on", "off"):
            raise ValueError(f"must be auto, on or off: {value!r}")
        return value

    @field_validator("lease_seconds", "heartbeat_seconds", "reap_seconds", "reclaim_poll_seconds", "audit_seconds")
    @classmethod
    def _check_positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be positive: {value}")
        return value

    @property
    def store_url(self) -> str:
        return self.store or str(Path("renderfleet-output").resolve())

    @property
    def watch_reclaim(self) -> bool:
        if self.reclaim_watch == "auto":
            return "spot" in self.pool
        return self.reclaim_watch == "on"


def load_settings(**overrides: Any) -> Settings:
    """Build and validate the process's settings; flags win over the environment.

    A bad value raises :class:`ConfigError` naming the variable, e.g.
    ``RENDERFLEET_REDIS_URL: must start with redis://...``.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"RENDERFLEET_{name.upper()}: {msg}")
        raise ConfigError("; ".join(lines)) from None
    if settings.heartbeat_seconds * 2 > settings.lease_seconds:
        raise ConfigError(
            "RENDERFLEET_HEARTBEAT_SECONDS must be at most half of RENDERFLEET_LEASE_SECONDS "
            f"({settings.heartbeat_seconds} vs {settings.lease_seconds})"
        )
    return settings
