"""A worker's own /metrics: the loopback and token rule, prometheus naming, and what the ledger counts.

The ledger runs under the real shard runner with plain objects (a renderer
that returns bytes, a folder store, leases in memory); the endpoint is real
(uvicorn in a thread) and is scraped over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from renderfleet import spec
from renderfleet.errors import ConfigError, PromptError, Reclaimed
from renderfleet.leases import Lease
from renderfleet.settings import Settings
from renderfleet.spec import Prompt, RenderParams, ShardMessage, store_tag
from renderfleet.store import LocalStore
from testing.servers import free_port, http_get
from worker.accounting.metrics import BadImages, ImageOutcome, LostReason, WorkerMetrics, serve_metrics
from worker.lease.ledger import RedisLedger
from worker.node.stop import StopSignal
from worker.render.runner import ShardRunner

# "stage": generate, or a stage's kind and position (upscale-1, refine-2): at most 1 + 2 x MAX_STAGES values
BOUNDED_LABELS = {"pool", "outcome", "cloud", "kind", "reason", "what", "error", "le", "stage"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return samples(generate_latest(metrics.registry).decode())[(name, tuple(sorted({"pool": "spot", **labels}.items())))]


# ---- the endpoint: loopback unless told, off it only with the token ------------------


@pytest.fixture
def endpoints() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for endpoint in started:
        endpoint.shutdown()


def test_a_worker_serves_no_metrics_unless_given_a_port() -> None:
    assert serve_metrics(WorkerMetrics("spot"), Settings(metrics_port=0)) is None


def test_on_loopback_the_worker_metrics_are_served_without_a_token(endpoints: list[Any]) -> None:
    metrics = WorkerMetrics("spot")
    metrics.images(ImageOutcome.RENDERED, 3)
    endpoint = serve_metrics(metrics, Settings(metrics_port=free_port()))
    assert endpoint is not None
    endpoints.append(endpoint)
    status, body = http_get(f"http://127.0.0.1:{endpoint.server_port}/metrics")
    assert status == 200
    assert samples(body.decode())[("renderfleet_worker_images_total", (("outcome", "rendered"), ("pool", "spot")))] == 3


def test_off_loopback_the_worker_metrics_refuse_to_start_without_the_token_and_then_enforce_it(
    endpoints: list[Any],
) -> None:
    with pytest.raises(ConfigError, match="RENDERFLEET_HTTP_TOKEN") as info:
        serve_metrics(WorkerMetrics("spot"), Settings(metrics_host="0.0.0.0", metrics_port=free_port()))
    assert "RENDERFLEET_METRICS_HOST" in str(info.value)
    endpoint = serve_metrics(
        WorkerMetrics("spot"), Settings(metrics_host="0.0.0.0", metrics_port=free_port(), http_token="s3cret-metrics-token")
    )
    assert endpoint is not None
    endpoints.append(endpoint)
    url = f"http://127.0.0.1:{endpoint.server_port}/metrics"
    assert http_get(url)[0] == 401
    assert http_get(url, token="wrong")[0] == 401
    assert http_get(url, token="s3cret-metrics-token")[0] == 200


def test_a_token_set_is_needed_on_loopback_too(endpoints: list[Any]) -> None:
    endpoint = serve_metrics(WorkerMetrics("spot"), Settings(metrics_port=free_port(), http_token="s3cret-metrics-token"))
    assert endpoint is not None
    endpoints.append(endpoint)
    assert http_get(f"http://127.0.0.1:{endpoint.server_port}/metrics")[0] == 401


def test_every_metric_follows_prometheus_naming_with_bounded_labels_only() -> None:
    metrics = WorkerMetrics("spot")
    metrics.batch(0.5)
    metrics.model_loaded(2.0)
    metrics.notice("aws", "instance-action")
    metrics.retry("s3", "throttled")
    metrics.lost_batch(LostReason.FENCED)
    metrics.bad_images(BadImages.RERENDERED, 2)
    metrics.stage_images("refine-2", 4)
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    # (prometheus_client adds a ``_created`` gauge beside each counter and histogram in the text format)
    ours = [f for f in families if f.name.startswith("renderfleet_") and not f.name.endswith("_created")]
    assert {f.name for f in ours} == {
        "renderfleet_worker_images",
        "renderfleet_worker_batch_seconds",
        "renderfleet_worker_render_seconds",
        "renderfleet_worker_model_load_seconds",
        "renderfleet_worker_reclaim_notices",
        "renderfleet_worker_lost_batches",
        "renderfleet_worker_retries",
        "renderfleet_worker_bad_images",
        "renderfleet_worker_stage_images",
    }
    from worker.accounting.gputime import WorkerTime

    metrics.watch_time(WorkerTime())
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    ours = [f for f in families if f.name.startswith("renderfleet_") and not f.name.endswith("_created")]
    assert "renderfleet_worker_gpu_seconds" in {f.name for f in ours}
    for family in ours:
        assert family.name.startswith("renderfleet_worker_")
        for s in family.samples:
            assert set(s.labels) <= BOUNDED_LABELS, s
            if family.type == "counter":
                assert s.name.endswith("_total"), s.name
    # No CUDA here: the GPU memory peak is absent, not a made-up 0.
    assert not any(f.name == "renderfleet_worker_gpu_memory_peak_bytes" for f in families)
    assert value(metrics, "renderfleet_worker_render_seconds_total") == 0.5
    assert value(metrics, "renderfleet_worker_batch_seconds_count") == 1
    assert value(metrics, "renderfleet_worker_bad_images_total", outcome="rerendered") == 2
    assert value(metrics, "renderfleet_worker_bad_images_total", outcome="refused") == 0  # there from the start


def test_a_signal_first_is_a_notice_but_the_sigterm_a_cloud_notice_sends_is_not_counted_again() -> None:
    from celery import signals

    from worker.lease import tasks

    for first_came in ("signal", "cloud"):
        stop, heard = StopSignal(), []
        tasks.install_shutdown_hooks(stop, 25.0, on_signal=heard.append)
        if first_came == "cloud":
            stop.request("aws spot terminate", seconds_left=120)  # the watcher, then its SIGTERM to this process
        signals.worker_shutting_down.send(sender="w", sig="SIGTERM", how="Warm", exitcode=0)
        assert heard == (["sigterm"] if first_came == "signal" else []), first_came
        assert stop.requested


# ---- what the ledger counts, under the real shard runner ---------------------------


PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32)


def shard(n: int, batch: int) -> ShardMessage:
    prompts = tuple(
        Prompt(
            index=i,
            name=spec.index_name(i),
            prompt=f"p{i}",
            negative_prompt="",
            seed=spec.derive_seed(0, i),
            steps=2,
            guidance=7.5,
            width=32,
            height=32,
        )
        for i in range(n)
    )
    return ShardMessage(job="j", shard=0, params=PARAMS, batch_size=batch, queue="q", prompts=prompts)


class BytesRenderer:
    """Bytes for each prompt; a prompt named in ``bad`` fails as the prompt's own fault."""

    last_batch_seconds: float | None = None

    def __init__(self, bad: frozenset[str] = frozenset(), before: Callable[[], None] = lambda: None):
        self.bad, self.before = bad, before

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[bytes]:
        self.before()
        if should_stop():
            raise Reclaimed("stopped mid-batch")
        if any(p.name in self.bad for p in prompts):
            raise PromptError("this prompt fails")
        return [p.name.encode() for p in prompts]

    def encode(self, image: bytes, prompt: Prompt) -> bytes:
        return image


class PlainLeases:
    """What the ledger asks of :class:`~renderfleet.leases.Leases`, in memory; ``fenced`` after a newer claim."""

    def __init__(self) -> None:
        self.client = self
        self.fenced = False
        self.failures: dict[int, int] = {}

    def current(
        self,
        lease: Lease,
        pipe: Any = None,
        *,
        counts: Any = None,
        progress: str = "",
        stages: Any = None,
        store_tag: str = "",
    ) -> bool:
        return not self.fenced

    def commit(self, lease: Lease, done: Sequence[int], failed: Sequence[int], undone: Sequence[int] = ()) -> None:
        pass

    def record_failure(self, lease: Lease, index: int, error: str) -> int:
        self.failures[index] = self.failures.get(index, 0) + 1
        return self.failures[index]

    # the Redis client's counters: nothing to keep here
    def pipeline(self, transaction: bool = True) -> PlainLeases:
        return self

    def hincrby(self, *args: Any) -> None:
        pass

    lpush = ltrim = expire = hincrby

    def execute(self) -> list[Any]:
        return []


def deliver(
    store: LocalStore,
    renderer: BytesRenderer,
    metrics: WorkerMetrics,
    msg: ShardMessage,
    *,
    leases: PlainLeases | None = None,
    stop: StopSignal | None = None,
) -> None:
    stop = stop or StopSignal()
    lease = Lease(job="j", shard=0, worker="w", attempt=1, queue="q", tag="t", requeue="", message="")
    ledger = RedisLedger(
        leases or PlainLeases(),
        lease,
        stop,
        pool="spot",
        store_tag=store_tag(store.url),  # type: ignore[arg-type]
        metrics=metrics,
    )
    runner = ShardRunner(store=store, renderer=renderer, stop=stop, max_failures=1, upload_threads=2)
    try:
        runner.run(msg, ledger, attempt=1)
    finally:
        runner.close()


def test_images_are_counted_by_outcome_and_a_second_delivery_counts_them_skipped(tmp_path: Path) -> None:
    store, metrics = LocalStore(tmp_path / "store"), WorkerMetrics("spot")
    deliver(store, BytesRenderer(bad=frozenset({"000002"})), metrics, shard(5, 2))
    counted = {o: value(metrics, "renderfleet_worker_images_total", outcome=o) for o in ImageOutcome}
    assert counted == {"rendered": 4, "failed": 1, "quarantined": 1, "skipped": 0}
    assert value(metrics, "renderfleet_worker_batch_seconds_count") == 3
    deliver(store, BytesRenderer(), metrics, shard(5, 2))  # everything is in the store: nothing rendered again
    assert value(metrics, "renderfleet_worker_images_total", outcome="skipped") == 5
    assert value(metrics, "renderfleet_worker_images_total", outcome="rendered") == 4


def test_a_batch_abandoned_on_a_notice_is_a_lost_batch_and_counts_no_image(tmp_path: Path) -> None:
    store, metrics, stop = LocalStore(tmp_path / "store"), WorkerMetrics("spot"), StopSignal()
    with pytest.raises(Reclaimed):
        deliver(
            store, BytesRenderer(before=lambda: stop.request("spot notice", seconds_left=0)), metrics, shard(4, 2), stop=stop
        )
    assert value(metrics, "renderfleet_worker_lost_batches_total", reason="abandoned") == 1
    assert value(metrics, "renderfleet_worker_lost_batches_total", reason="fenced") == 0
    assert value(metrics, "renderfleet_worker_images_total", outcome="rendered") == 0


def test_a_batch_rendered_by_a_fenced_worker_is_a_lost_batch(tmp_path: Path) -> None:
    store, metrics, leases = LocalStore(tmp_path / "store"), WorkerMetrics("spot"), PlainLeases()

    def newer_claim() -> None:  # the shard is taken over while this batch renders
        leases.fenced = True

    with pytest.raises(Reclaimed):
        deliver(store, BytesRenderer(before=newer_claim), metrics, shard(4, 2), leases=leases)
    assert value(metrics, "renderfleet_worker_lost_batches_total", reason="fenced") == 1
    assert value(metrics, "renderfleet_worker_images_total", outcome="rendered") == 0
    assert value(metrics, "renderfleet_worker_render_seconds_total") > 0  # the GPU time was spent all the same


class CountingLeases(PlainLeases):
    """:class:`PlainLeases` that keeps the job's own counters a passing fence check writes."""

    def __init__(self) -> None:
        super().__init__()
        self.job: dict[str, int] = {}

    def current(
        self,
        lease: Lease,
        pipe: Any = None,
        *,
        counts: Any = None,
        progress: str = "",
        stages: Any = None,
        store_tag: str = "",
    ) -> bool:
        if not self.fenced:
            for name, n in (counts or {}).items():
                self.job[name] = self.job.get(name, 0) + n
        return not self.fenced


def test_a_committed_batchs_time_is_kept_and_a_fenced_ones_lost_in_the_account_the_job_and_metrics(
    tmp_path: Path,
) -> None:
    from worker.accounting.gputime import Use, WorkerTime

    now = [50.0]
    account = WorkerTime(lambda: now[0], started=now[0])
    store, metrics, leases, stop = LocalStore(tmp_path / "store"), WorkerMetrics("spot"), CountingLeases(), StopSignal()
    metrics.watch_time(account)
    calls = [0]

    def one_second_each() -> None:  # the clock's second per batch; the shard taken over during the third
        now[0] += 1.0
        calls[0] += 1
        leases.fenced = calls[0] == 3

    lease = Lease(job="j", shard=0, worker="w", attempt=1, queue="q", tag="t", requeue="", message="")
    ledger = RedisLedger(leases, lease, stop, pool="spot", store_tag="t", metrics=metrics, time_account=account)  # type: ignore[arg-type]
    runner = ShardRunner(  # commits in line: the first is counted before the second batch renders
        store=store, renderer=BytesRenderer(before=one_second_each), stop=stop, pipeline_depth=0, time_account=account
    )
    try:
        with pytest.raises(Reclaimed):
            runner.run(shard(6, 2), ledger, attempt=1)
    finally:
        runner.close()
    assert account.settle("j:0") == 1.0  # the shard's end (WorkerService._end): the fenced batch is lost
    assert account.totals()[Use.KEPT] == 2.0 and account.totals()[Use.LOST] == 1.0
    assert value(metrics, "renderfleet_worker_gpu_seconds_total", kind="kept") == 2.0
    assert value(metrics, "renderfleet_worker_gpu_seconds_total", kind="lost") == 1.0
    assert value(metrics, "renderfleet_worker_gpu_seconds_total", kind="idle") == 0.0
    ledger.flush()
    # The job's own, written by a current attempt only: the first batch's.  The second's kept seconds rode
    # on the next fence check, which found the attempt superseded: its pool's alone (docs/pools.md).  Nor is
    # a fenced attempt's loss the job's (the reaper's estimate is, when the lease expired).
    assert leases.job.get("kept_ms.spot") == 1000 and "lost_ms.spot" not in leases.job
