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
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from renderfleet import renderconfig
from renderfleet.allowlist import entry_problem
from renderfleet.errors import ConfigError
from renderfleet.keys import RECENT_BUCKET_SECONDS, RECENT_KEEP_SECONDS
from renderfleet.redaction import redact  # also renderfleet.settings.redact, as callers know it
from renderfleet.spec import INT_LIMITS
from renderfleet.webhooks import url_problem

if TYPE_CHECKING:  # the store imports botocore: not for every CLI start
    from renderfleet.store import S3Options

_POOL_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
# A Host header entry of RENDERFLEET_HTTP_HOSTS: a DNS name or an address, with an optional port.
_HOST_RE = re.compile(r"^([a-z0-9][a-z0-9.-]*|\[[0-9a-f:.]+\])(:[0-9]{1,5})?$")
MIN_TOKEN_LENGTH = 16  # characters: a guessable token on a network is none


# Why a Redis URL cannot be used, quoting it only redacted: a URL that does not
# parse as meant is one whose password may show up as its host, port or path.
_UNPARSABLE = (
    "cannot be parsed as redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (got {}); a '/', '?', '#' "
    "or '@' in a user name or password must be percent-encoded as %2F, %3F, %23 or %40"
)


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a Redis URL, if it cannot; never quoting the URL but
    through :func:`redact`, whose output holds no user name or password."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        from renderfleet.redisconn import sentinel_problem

        return sentinel_problem(url)
    if scheme not in ("redis", "rediss", "unix"):
        return (
            f"must start with redis://, rediss://, unix:// or (a Sentinel-managed Redis) "
            f"redis+sentinel:// or rediss+sentinel://, got {redact(url)!r}"
        )
    if not url.isprintable():
        return "contains a control or other unprintable character"
    unparsable = _UNPARSABLE.format(repr(redact(url)))
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError when the "port" is not a number (part of a password)
    except ValueError:
        return unparsable
    if "#" in url or "@" in parts.path + parts.query:
        return unparsable  # the netloc ended early: at a / ? or # in the password
    if parts.username and parts.password is None:
        # redis://secret@host: redis-py would send it as a user name, and logs show user names.
        return "names a user but no password; a password alone is written redis://:PASSWORD@HOST"
    if scheme == "unix":
        return None if parts.path.strip("/") else "unix:// needs the socket's path: unix:///path/to/redis.sock"
    if not parts.hostname:
        return unparsable if parts.netloc else "names no host: redis://HOST[:PORT][/DB]"
    if parts.path.strip("/") and not parts.path.strip("/").isdigit():
        return "the path after the host must be a database number (redis://HOST:PORT/0)"
    return None


def gpus_problem(value: str) -> str | None:
    """Why ``value`` is not ``all``, a count of GPUs or a list of their indexes; None when it is one."""
    value = value.strip().lower()
    if value == "all" or (value.isdigit() and int(value) >= 1):
        return None
    if value.isdigit():
        return f"a count of GPUs is 1 or more, got {value!r}"
    entries = [e.strip() for e in value.split(",")]
    if len(entries) < 2 or not all(e.isdigit() for e in entries):
        return f"must be all, a count of GPUs (2) or their indexes separated by commas (0,2,3), got {value!r}"
    if len({int(e) for e in entries}) != len(entries):
        return f"a GPU is named twice in {value!r}"
    return None


def _default_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "renderfleet"


class PoolConfig(BaseModel):
    """One worker pool (a ``[pools.NAME]`` table of the config file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # on-demand: the warm floor, always up; spot: overflow, sized by the backlog.
    kind: Literal["on-demand", "spot"] = "on-demand"
    # Price per hour, in the user's currency, of one GPU (one worker) or one node: as price_per says.
    price_per_hour: float = Field(default=0.0, ge=0)
    # What price_per_hour is the price of: "gpu" or "node" (a node's is divided by gpus_per_node, once,
    # in gpu_price_per_hour: every cost, budget and estimate counts GPU-hours).
    price_per: Literal["gpu", "node"] = "gpu"
    # GPUs on one node of this pool (g6.12xlarge: 4), a worker each under `worker --gpus`: the
    # autoscaler decides in GPUs and asks the backend for nodes (docs/pools.md, "Nodes with several GPUs").
    gpus_per_node: int = Field(default=1, ge=1, le=64)
    # The fewest and most workers (GPUs): whole nodes, multiples of gpus_per_node.
    min: int = Field(default=0, ge=0)
    max: int = Field(default=1, ge=0)
    # The card of its workers as a worker names it in `status --json` ("NVIDIA H100 80GB HBM3"):
    # `submit --estimate` reads the speeds measured on it while none of them is up.  None: their own word.
    card: str | None = None
    # Its card's memory in GiB, as a worker reports it (an H100 80GB: 79.6): the autoscaler grows it for a
    # job's --min-vram work only where its card qualifies (renderfleet/cards.py).  None: its live workers' word.
    vram_gib: float | None = Field(default=None, gt=0, le=4096, allow_inf_nan=False)
    # The most its workers may cost in a calendar month (UTC), at price_per_hour: the autoscaler counts
    # their up-time and sizes the pool to 0 once the month's spend reaches it (docs/pools.md, "Budgets").
    monthly_budget: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Who starts and stops its workers: processes here, a Deployment (its replicas set by the
    # autoscaler, or by KEDA from the published decision), an Auto Scaling group.
    backend: Literal["local", "kubernetes", "keda", "aws"] = "local"
    # kubernetes, keda: the Deployment of this pool's workers.
    namespace: str = "renderfleet"
    deployment: str | None = None
    # aws: the pool's EC2 Auto Scaling group.
    autoscaling_group: str | None = None
    region: str | None = None

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolConfig:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        for key, value in (("min", self.min), ("max", self.max)):
            if value % self.gpus_per_node:
                # A part of a node cannot be started: say which whole numbers would do.
                low = value // self.gpus_per_node * self.gpus_per_node
                whole = " or ".join(str(n) for n in (low, low + self.gpus_per_node) if n or key == "min")
                raise ValueError(
                    f"{key} = {value} is not a whole number of nodes of gpus_per_node = {self.gpus_per_node} "
                    f"GPUs ({key} counts GPUs, a worker each): give {whole}"
                )
        if self.monthly_budget is not None and self.price_per_hour <= 0:
            raise ValueError(
                f"monthly_budget = {self.monthly_budget:g} needs a price_per_hour (the spend is counted "
                "at it), and the pool has none"
            )
        return self

    @property
    def gpu_price_per_hour(self) -> float:
        """Price of one GPU (one worker) per hour: what every cost is counted at (status, budgets,
        estimates, the published prices); a node's price divided by its GPUs, here and nowhere else."""
        return self.price_per_hour / self.gpus_per_node if self.price_per == "node" else self.price_per_hour

    def nodes(self, gpus: int) -> int:
        """The nodes that carry ``gpus`` GPUs: rounded up (a part of a node is a whole node)."""
        return -(-max(gpus, 0) // self.gpus_per_node)


class AutoscaleConfig(BaseModel):
    """The ``[autoscale]`` table: how the policy sizes the pools."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The backlog should be cleared within this long; more wakes spot workers.
    drain_seconds: float = Field(default=600.0, gt=0)
    # A pool that changed size waits this long before it may shrink.
    cooldown_seconds: float = Field(default=300.0, ge=0)
    # A worker's cold start (boot, pull, model load) until one has been measured.
    cold_start_seconds: float = Field(default=180.0, gt=0)
    # Shrink only when one worker fewer would still clear the backlog within
    # this fraction of drain_seconds (hysteresis: no flapping).
    scale_in_margin: float = Field(default=0.7, gt=0, le=1)
    # How often `renderfleet autoscale` decides.
    interval_seconds: float = Field(default=15.0, gt=0)
    # A spot pool's throughput is discounted by the share of the work it started in
    # this long that reclaims threw away: recent, not since the pool began.
    reclaim_window_seconds: float = Field(default=900.0, ge=RECENT_BUCKET_SECONDS, le=RECENT_KEEP_SECONDS)


class EventsConfig(BaseModel):
    """The ``[events]`` table: signed events about jobs, sent by the monitor (docs/monitoring.md, "Events")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Post to loopback and private addresses too (a receiver beside the fleet, tests); off: refused.
    allow_private: bool = False
    # The receiver of every job that names none (submit --webhook); None: only those that name one.
    webhook: str | None = None
    # The file holding the signing secret (whsec_ and 24 or more random bytes in base64): the monitor
    # signs every event with it and sends none without it.
    secret_file: Path | None = None
    # One POST's read timeout (its connect timeout: this, at most 3 s): a receiver answers quickly and works later.
    timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    # The wait before the first retry of a failed delivery; each next one waits twice as long, at most
    # 10 minutes, until the event is delivered.
    retry_seconds: float = Field(default=1.0, gt=0, le=600)

    @field_validator("webhook")
    @classmethod
    def _check_webhook(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or value == "":
            return None
        # allow_private is declared first, so it is checked (or defaulted) by now
        if why := url_problem(value, allow_private=bool(info.data.get("allow_private"))):
            raise ValueError(why)
        return value


class Settings(BaseSettings):
    """Everything a renderfleet process can be told."""

    model_config = SettingsConfigDict(env_prefix="RENDERFLEET_", extra="ignore", frozen=True, env_nested_delimiter="__")

    # Broker and fleet state.  None: use (or start) the embedded local server.
    redis_url: str | None = None
    # Where images, checkpoints and specs go: s3://bucket/prefix or a folder.
    # None: the folder ./renderfleet-output.
    store: str | None = None
    # The model a worker loads at start-up (None: the built-in tiny one, until a job names
    # another) and submit's when --model is left out (None: submit asks for one; the
    # random-weight tiny model renders noise, so it is never a production default).
    model: str | None = None
    # Where the embedded server, the model cache and local state live.
    home: Path = Field(default_factory=_default_home)
    # Which pool this worker belongs to (baseline, spot, ...): its queue and its metrics label.
    pool: str = "default"
    # Poll cloud metadata for reclaim notices: auto = when the pool name contains "spot".
    reclaim_watch: str = "auto"
    aws_metadata_url: str = "http://169.254.169.254"
    gcp_metadata_url: str = "http://metadata.google.internal"
    # The EC2 Auto Scaling group this worker's instance belongs to: the worker protects
    # its instance from scale-in while it holds a shard (worker/node/protection.py).  None: off.
    aws_autoscaling_group: str | None = None
    # This worker's pod and namespace, from the downward API (infra/k8s): the worker
    # marks its pod with a pod-deletion-cost, busy high, idle low, so a scale-in of
    # its Deployment picks idle pods (worker/node/protection.py).  None: not in a pod, off.
    pod_name: str | None = None
    pod_namespace: str | None = None
    # A file the worker touches at every reaper tick once its model is loaded and it is
    # registered: a probe reads its age (infra/k8s/overlays/spot).  None: no file.
    health_file: Path | None = None
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
    # batch sizes, at a large cost in throughput (see worker/render/pipeline.py).
    batch_invariant: bool = False
    # Rendered batches whose upload, checkpoint and count may still run while the next
    # batch renders (worker/render/commits.py); 0: store each batch before rendering the next.
    pipeline_depth: int = Field(default=2, ge=0, le=8)
    # Prompts a worker renders per pipeline call: "auto" (the most that fit on a GPU, the
    # fastest on a CPU, found once per card, model and resolution and remembered in the
    # store) or a number; never more than the job's batch (worker/render/batchsize.py).
    render_batch: str = "auto"
    # Under auto on an accelerator: the smallest probed size whose images per second is within this
    # fraction of the fastest size's (the knee of the curve; 0: the fastest); a smaller call costs
    # less memory and time, and a larger one past the knee buys a few percent (worker/render/batchsize.py).
    batch_knee: float = Field(default=0.05, ge=0, lt=1)
    # Compile the denoiser's repeated blocks (the UNet's or transformer's; CUDA only).
    compile: bool = False
    # What --compile compiles: "regional" (the denoiser's repeated blocks: seconds cold) or "whole" (the
    # whole denoiser, convolutions too, and the VAE's decoder: minutes cold, shared through the compile cache).
    compile_mode: Literal["regional", "whole"] = "regional"
    # Where a CUDA worker's weights wait between calls: "none" (all on the card) or "model" (each
    # component in host memory until it runs: diffusers' enable_model_cpu_offload, needs accelerate),
    # for a model bigger than the card (worker/render/models/memory.py).  The images' bytes are the same.
    offload: str = "none"
    # The denoiser's and T5 encoder's linear layers in 8 bits (torchao): "none"; weight-only, for a model
    # bigger than the card, "int8" (anywhere) or "fp8" (a card with fp8: Ada, Hopper); weights and
    # activations, for speed, "fp8-dynamic" (a card with fp8) or "int8-dynamic".  The images differ from
    # unquantized ones and record it; a job asking for a recipe renders only on its workers
    # (renderfleet.renderconfig.QUANTIZE, worker/render/models/quantize.py).
    quantize: str = "none"
    # Which of torch's attention kernels a CUDA worker tries first: "auto" (torch's order), "flash", "cudnn"
    # (cuDNN's fused attention: Hopper's fastest where it applies) or "efficient"; the others stay behind it,
    # so a shape the first cannot take still renders.  Other kernels, other bytes: part of the render
    # configuration (renderfleet.renderconfig.ATTENTION, worker/render/models/cuda.py).
    attention: str = "auto"
    # A file holding the fleet's key (32 bytes or more) for the compile cache: with it, compiled
    # kernels are shared through the store signed (HMAC-SHA256), and only signed ones are loaded;
    # None: not shared, each node compiles for itself (worker/render/compiled.py).
    compile_cache_key_file: Path | None = None
    # The models a worker may load, comma-separated: ids (``tiny``, ``org/name``: a hub id at
    # main or any commit, never refs/pr/*), ``org/name@COMMIT`` (that commit only), folders (the
    # folder and everything in it) and ``s3://bucket/prefix`` (that prefix and below)
    # (renderfleet/allowlist.py).  None: any model.  A job naming another fails, not the worker;
    # submit applies it too where its environment sets it.
    allowed_models: str | None = None
    # Serve the reserved ``bench:fixed?seconds=S`` models (renderfleet.spec.bench_seconds): no
    # model, a fixed time per image, flat-colour PNGs marked as fake.  Off: a job naming one
    # fails with the reason, as for any model that will not load.  For benchmarks and tests only.
    allow_bench_models: bool = False
    # `renderfleet worker --gpus`: one worker process per GPU under a node supervisor
    # (worker/node/supervisor.py): "all" (every CUDA device of the node), N (the first N) or indexes
    # (0,2,3).  None: one worker, in this process.
    gpus: str | None = None
    # Set by a node supervisor in each worker it starts: the node's id and the GPU the worker was
    # given (its index on the node).  Such a worker leaves the reclaim notices and the scale-in marks
    # to the node and tells it whether it is busy instead (worker/node/board.py).  None: a worker on its own.
    node: str | None = None
    node_gpu: str | None = None
    # For tests only: the node supervisor's GPUs are this many stand-ins, no CUDA (each worker on the
    # CPU, its CUDA_VISIBLE_DEVICES a made-up id; one of them is made to fail by a failpoint for its
    # GPU alone: renderfleet/failpoints.py, POINT@gpuG).  Refused unless allow_stand_in_gpus is set,
    # as a bench model is unless allow_bench_models.
    stand_in_gpus: int = Field(default=0, ge=0, le=64)
    allow_stand_in_gpus: bool = False
    # For tests only: the card a bench model's worker reports, NAME:GB (a bench model has none; a real
    # device always reports its own): two bench workers of different "cards" for a --min-vram test.
    bench_card: str = Field(default="", pattern=r"^$|^[A-Za-z0-9 ._-]{1,64}:[0-9]{1,4}(\.[0-9]+)?$")
    # The largest total size of an s3:// model's files a worker will fetch, in bytes.
    model_max_bytes: int = Field(default=20 * 10**9, gt=0)
    # Device override for workers (cuda, cpu, mps); None: best available.
    device: str | None = None
    # S3 server-side encryption of every object written: AES256 (SSE-S3) or aws:kms (SSE-KMS).
    s3_sse: str | None = None
    # The KMS key for aws:kms (id, ARN or alias); None: the bucket's default key.
    s3_kms_key_id: str | None = None
    # Storage class of every object written (STANDARD, INTELLIGENT_TIERING, ...); None: the bucket's default.
    s3_storage_class: str | None = None
    # Bucket addressing: auto, path (MinIO and other S3-compatible stores) or virtual.
    s3_addressing: str = "auto"
    # Send Celery's task events (for Flower or celery-exporter beside the fleet).
    task_events: bool = False
    # Log lines as "text" (one readable line each) or "json" (one JSON object per line, with the
    # worker, job, shard and attempt where known, for log pipelines): renderfleet/logs.py.
    log_format: str = "text"
    # Required on every request to the monitor's HTTP endpoint and a worker's metrics
    # when they listen off loopback (and then on every request, wherever they listen).
    # At least MIN_TOKEN_LENGTH characters, no whitespace: `openssl rand -hex 32`.
    http_token: str | None = None
    # Without a token the monitor answers only requests whose Host is localhost,
    # 127.0.0.1 or [::1] with its port (a DNS-rebinding page reads nothing); these
    # names too, comma-separated: `name` for any port, `name:port` for that one.
    http_hosts: str | None = None
    # The monitor is reached through a reverse proxy that terminates TLS: its
    # X-Forwarded-Proto: https marks the login cookie Secure.  Only set it when
    # the proxy is the sole way in (a client could send the header itself).
    http_tls_proxy: bool = False
    # A worker's own Prometheus metrics (``/metrics``) on this port; 0: none.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # The address a worker's metrics listen on; off loopback only with http_token.
    metrics_host: str = "127.0.0.1"
    # The TOML file the pools (and any setting above) came from; None: no file.
    config: Path | None = None
    # Worker pools by name; empty: no scaling, a pool is just a queue.
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    # Signed events about jobs (the [events] table).
    events: EventsConfig = Field(default_factory=EventsConfig)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        problem = redis_url_problem(value)
        if problem:
            raise ValueError(problem)
        if value.lower().startswith("rediss://") and "ssl_cert_reqs" not in value:
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

    @field_validator("allowed_models")
    @classmethod
    def _check_allowed_models(cls, value: str | None) -> str | None:
        for entry in (value or "").split(","):
            if why := entry_problem(entry.strip()):
                raise ValueError(why)
        return value

    @field_validator("http_token")
    @classmethod
    def _check_token(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        # The token itself is never shown: only what is wrong with it.
        if len(value) < MIN_TOKEN_LENGTH or not value.isprintable() or any(c.isspace() for c in value):
            raise ValueError(
                f"must be at least {MIN_TOKEN_LENGTH} characters with no whitespace "
                f"(e.g. `openssl rand -hex 32`), got {len(value)} characters"
            )
        return value

    @field_validator("http_hosts")
    @classmethod
    def _check_hosts(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        for entry in value.split(","):
            if not _HOST_RE.match(entry.strip().lower()):
                raise ValueError(
                    f"expected host names such as monitor.internal or monitor.internal:8080, "
                    f"comma-separated; got {entry.strip()!r}"
                )
        return value

    @field_validator("s3_sse")
    @classmethod
    def _check_sse(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        if value not in ("AES256", "aws:kms", "aws:kms:dsse"):
            raise ValueError(f"must be AES256, aws:kms or aws:kms:dsse, got {value!r}")
        return value

    @field_validator("render_batch")
    @classmethod
    def _check_render_batch(cls, value: str) -> str:
        value = value.strip().lower()
        low, high = INT_LIMITS["batch_size"]
        if value != "auto" and not (value.isdigit() and low <= int(value) <= high):
            raise ValueError(f"must be auto or a whole number from {low} to {high}, got {value!r}")
        return value

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if why := gpus_problem(value):
            raise ValueError(why)
        return value.strip().lower()

    @field_validator("log_format")
    @classmethod
    def _check_log_format(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in ("text", "json"):
            raise ValueError(f"must be text or json, got {value!r}")
        return value

    @field_validator("offload")
    @classmethod
    def _check_offload(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in ("none", "model"):
            raise ValueError(
                f"must be none or model, got {value!r} (model: each component on the card only while it "
                "runs, for a model bigger than the card)"
            )
        return value

    @field_validator("quantize", "attention")
    @classmethod
    def _check_render_lever(cls, value: str, info: ValidationInfo) -> str:
        """A lever of the render configuration (renderfleet/renderconfig.py), one of its table's names."""
        value = value.strip().lower()
        problem, what = {
            "quantize": (renderconfig.quantize_problem, "the denoiser's and T5's linear layers in 8 bits"),
            "attention": (renderconfig.attention_problem, "which of torch's attention kernels a CUDA worker tries first"),
        }[str(info.field_name)]
        if why := problem(value):
            raise ValueError(f"{why} ({what})")
        return value

    @field_validator("s3_addressing")
    @classmethod
    def _check_addressing(cls, value: str) -> str:
        if value not in ("auto", "path", "virtual"):
            raise ValueError(f"must be auto, path or virtual, got {value!r}")
        return value

    @field_validator("pool")
    @classmethod
    def _check_pool(cls, value: str) -> str:
        if not _POOL_RE.match(value):
            raise ValueError(f"pool names are lowercase letters, digits, - and _: {value!r}")
        return value

    @field_validator("pools")
    @classmethod
    def _check_pool_names(cls, value: dict[str, PoolConfig]) -> dict[str, PoolConfig]:
        for name in value:
            if not _POOL_RE.match(name):
                raise ValueError(f"pool names are lowercase letters, digits, - and _: {name!r}")
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
    def gpu_prices(self) -> dict[str, float]:
        """Each pool's price per GPU-hour (0: none): the one conversion of a node's price."""
        return {name: pool.gpu_price_per_hour for name, pool in self.pools.items()}

    @property
    def store_url(self) -> str:
        return self.store or str(Path("renderfleet-output").resolve())

    @property
    def s3_options(self) -> S3Options:
        """How every S3 object is written (encryption, storage class, addressing)."""
        from renderfleet.store import S3Options

        return S3Options(
            sse=self.s3_sse,
            kms_key_id=self.s3_kms_key_id or None,
            storage_class=self.s3_storage_class or None,
            addressing=self.s3_addressing,
        )

    @property
    def http_host_list(self) -> tuple[str, ...]:
        """The Host header values the tokenless monitor answers beside loopback's."""
        return tuple(h.strip().lower() for h in (self.http_hosts or "").split(",") if h.strip())

    @property
    def fixed_render_batch(self) -> int | None:
        """The worker's render size when fixed; None for auto."""
        return None if self.render_batch == "auto" else int(self.render_batch)

    @property
    def allowed_model_list(self) -> tuple[str, ...] | None:
        """The allow-list of models, or None when any model may be loaded."""
        if self.allowed_models is None or not self.allowed_models.strip():
            return None
        return tuple(entry.strip() for entry in self.allowed_models.split(",") if entry.strip())

    @property
    def watch_reclaim(self) -> bool:
        if self.node:  # a worker of a node supervisor: the node watches, once for all its GPUs
            return False
        if self.reclaim_watch == "auto":
            return "spot" in self.pool
        return self.reclaim_watch == "on"


def _read_toml(path: Path) -> dict[str, Any]:
    """The config file's tables; ConfigError naming the file when it cannot be used."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(Settings.model_fields) - {"config"})
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {unknown[0]!r} (known: pools, autoscale, events, and the settings of "
            "RENDERFLEET_* in lowercase)"
        )
    return data


def _with_file(path: Path) -> type[Settings]:
    """Settings read from ``path`` too, below flags and the environment."""

    class FileSettings(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=path))

    return FileSettings


def _from_file(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    node: Any = data
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def load_settings(**overrides: Any) -> Settings:
    """Build and validate the process's settings; flags win over the environment,
    which wins over the config file (``config=`` or ``RENDERFLEET_CONFIG``).

    A bad value raises :class:`ConfigError` naming the variable, e.g.
    ``RENDERFLEET_REDIS_URL: must start with redis://...``, or the file, key
    and value: ``fleet.toml: pools.spot.max = -1: ...``.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    path = given.get("config") or os.environ.get("RENDERFLEET_CONFIG") or None
    data: dict[str, Any] = {}
    cls = Settings
    if path:
        path = Path(path)
        given["config"] = path
        data = _read_toml(path)
        cls = _with_file(path)
    try:
        settings = cls(**given)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            if data and _from_file(data, loc[:1]) and loc[0] not in given:
                key = ".".join(str(p) for p in loc)
                shown = redact(err["input"]) if loc[0] == "redis_url" and isinstance(err["input"], str) else err["input"]
                value = f" = {shown!r}" if not isinstance(shown, dict) else ""
                lines.append(f"{path}: {key}{value}: {msg}")
            else:
                name = "__".join(str(p) for p in loc) if loc else "settings"  # a nested one: RENDERFLEET_EVENTS__WEBHOOK
                lines.append(f"RENDERFLEET_{name.upper()}: {msg}")
        raise ConfigError("; ".join(lines)) from None
    if settings.heartbeat_seconds * 2 > settings.lease_seconds:
        raise ConfigError(
            "RENDERFLEET_HEARTBEAT_SECONDS must be at most half of RENDERFLEET_LEASE_SECONDS "
            f"({settings.heartbeat_seconds} vs {settings.lease_seconds})"
        )
    return settings
