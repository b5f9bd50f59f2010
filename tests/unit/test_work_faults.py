"""Whose fault a failure is: the work's (job, prompt) never counts against the worker.

Plain objects only: a fake renderer, a folder store, a ledger in memory.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from renderfleet import spec
from renderfleet.embedded import free_port
from renderfleet.errors import JobError, ModelLoadError, PermanentError, PromptError, StoreError
from renderfleet.settings import Settings
from renderfleet.spec import Prompt, RenderParams, ShardMessage
from renderfleet.store import LocalStore
from worker.lease.service import WorkerService
from worker.node.stop import StopSignal
from worker.render.runner import ShardRunner

PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32)


def make_msg(n: int = 4, batch: int = 2) -> ShardMessage:
    prompts = tuple(
        Prompt(
            index=i,
            name=spec.index_name(i),
            prompt=f"p{i}",
            negative_prompt="",
            seed=i,
            steps=2,
            guidance=7.5,
            width=32,
            height=32,
        )
        for i in range(n)
    )
    return ShardMessage(job="j", shard=0, params=PARAMS, batch_size=batch, queue="q", prompts=prompts)


class Renderer:
    """Renders bytes, or raises ``error`` for every call."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.calls = 0
        self.last_batch_seconds: float | None = None

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[Any]:
        self.calls += 1
        if self.error:
            raise self.error
        return [f"png:{p.name}".encode() for p in prompts]

    def encode(self, image: Any, prompt: Prompt) -> bytes:
        return bytes(image)


class Ledger:
    def __init__(self) -> None:
        self.done: list[int] = []
        self.failed: list[int] = []
        self.failures: dict[int, int] = {}
        self.errors: dict[int, str] = {}

    def check(self) -> None:
        pass

    def life_ended(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None:
        self.done = [i for i in self.done if i not in undone] + done
        self.failed += failed

    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None:
        self.done = [i for i in self.done if i not in undone] + [i for i in done if i not in self.done]
        self.failed = [i for i in self.failed if i not in undone] + [i for i in failed if i not in self.failed]

    def record_failure(self, prompt: Prompt, error: str) -> int:
        self.failures[prompt.index] = self.failures.get(prompt.index, 0) + 1
        self.errors[prompt.index] = error
        return self.failures[prompt.index]

    def record_start(self, images: int) -> None:
        pass

    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None:
        pass

    def record_waste(self, images: int) -> None:
        pass


class RefusingStore(LocalStore):
    """A folder store that refuses some keys with an OSError."""

    def __init__(self, root: Path, refuse: dict[str, int]):
        super().__init__(root)
        self.refuse = refuse

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        for fragment, code in self.refuse.items():
            if fragment in key:
                raise OSError(code, "refused")
        super().put(key, data, content_type=content_type)

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        for fragment, code in self.refuse.items():
            if fragment in key:
                raise OSError(code, "refused")
        return super().put_new(key, data, content_type=content_type)


def runner(store: LocalStore, renderer: Renderer) -> ShardRunner:
    return ShardRunner(store=store, renderer=renderer, stop=StopSignal(), max_failures=3)


def test_a_job_error_fails_the_whole_batch_at_once_and_is_not_the_workers_fault(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    r = Renderer(JobError("the model rejects these settings: height must be divisible by 64"))
    result = runner(store, r).run(make_msg(), Ledger())
    assert r.calls == 2  # one per batch: a job's fault is not searched for prompt by prompt
    assert sorted(result.failed) == [0, 1, 2, 3] and result.excused == 4
    assert not result.all_failed


def test_the_same_failure_of_every_prompt_is_the_nodes_fault() -> None:
    from worker.render.runner import ShardResult

    assert ShardResult(failed=[0, 1], attempted=2).all_failed
    assert not ShardResult(failed=[0, 1], attempted=2, excused=2).all_failed
    assert ShardResult(failed=[0, 1, 2], attempted=3, excused=1).all_failed
    assert not ShardResult(failed=[0], attempted=1).all_failed


def test_an_image_the_store_refuses_fails_that_prompt_alone(tmp_path: Path) -> None:
    store = RefusingStore(tmp_path / "store", {"images/000001.png": errno.ENAMETOOLONG})
    ledger = Ledger()
    shard = runner(store, Renderer())
    result = shard.run(make_msg(), ledger)
    assert sorted(ledger.done) == [0, 2, 3] and result.failed == [1] and result.excused == 1
    assert "cannot store image '000001'" in ledger.errors[1]
    assert store.exists(spec.image_key("j", "000000")) and not store.exists(spec.image_key("j", "000001"))
    shard.run(make_msg(), ledger)
    result = shard.run(make_msg(), ledger)
    assert result.complete and result.quarantined == 1 and ledger.failed == [1]


def test_every_image_of_a_shard_refused_is_still_not_the_workers_fault(tmp_path: Path) -> None:
    store = RefusingStore(tmp_path / "store", {"images/": errno.EISDIR})
    result = runner(store, Renderer()).run(make_msg(), Ledger())
    assert sorted(result.failed) == [0, 1, 2, 3] and not result.all_failed


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_the_nodes_fault_and_commits_nothing(tmp_path: Path, code: int) -> None:
    store = RefusingStore(tmp_path / "store", {"images/": code})
    ledger = Ledger()
    with pytest.raises(OSError):
        runner(store, Renderer()).run(make_msg(), ledger)
    assert ledger.done == [] and ledger.failures == {}


def test_a_store_outage_is_raised_not_blamed_on_a_prompt(tmp_path: Path) -> None:
    class Down(LocalStore):
        def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
            raise StoreError("S3 503")

        def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
            raise StoreError("S3 503")

    ledger = Ledger()
    with pytest.raises(StoreError):
        runner(Down(tmp_path / "store"), Renderer()).run(make_msg(), ledger)
    assert ledger.failures == {}


def test_a_prompt_error_from_the_renderer_is_excused_and_isolated(tmp_path: Path) -> None:
    class OneBad(Renderer):
        def render_images(
            self,
            prompts: Sequence[Prompt],
            *,
            should_stop: Callable[[], bool] = lambda: False,
        ) -> list[Any]:
            if any(p.name == "000000" for p in prompts):
                raise PromptError("the pipeline refuses prompt '000000'")
            return super().render_images(prompts)

    result = runner(LocalStore(tmp_path / "store"), OneBad()).run(make_msg(n=2), Ledger())
    assert result.failed == [0] and result.rendered == 1 and result.excused == 1


def test_an_image_that_cannot_be_encoded_fails_its_prompt_alone_without_a_render_again(tmp_path: Path) -> None:
    class BadText(Renderer):
        def encode(self, image: Any, prompt: Prompt) -> bytes:
            if prompt.name == "000000":
                raise PromptError("cannot encode the image of '000000': text PNG cannot carry")
            return super().encode(image, prompt)

    renderer = BadText()
    ledger = Ledger()
    result = runner(LocalStore(tmp_path / "store"), renderer).run(make_msg(n=2), ledger)
    assert result.failed == [0] and result.rendered == 1 and result.excused == 1
    assert renderer.calls == 1 and ledger.done == [1] and "text PNG" in ledger.errors[0]


def test_a_plain_render_failure_still_counts_against_the_worker(tmp_path: Path) -> None:
    result = runner(LocalStore(tmp_path / "store"), Renderer(PermanentError("device lost"))).run(make_msg(), Ledger())
    assert result.all_failed and result.excused == 0


# ---- the service keeps its model ----------------------------------------------------


def service(tmp_path: Path, load: Callable[..., Any]) -> WorkerService:
    # Nothing listens on this port: the service's counters are best effort here.
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    return WorkerService(
        settings=Settings(home=tmp_path),
        client=client,
        store=LocalStore(tmp_path / "store"),
        renderer=Renderer(),
        model="tiny",
        stop=StopSignal(),
        publish=lambda m: None,
        worker_id="w",
        load_model=load,
    )


def test_a_model_that_will_not_load_leaves_the_worker_its_own_and_is_tried_again_later(tmp_path: Path) -> None:
    loads: list[str] = []

    def load(model: str, *_: object) -> Renderer:
        loads.append(model)
        if model == "./nope":
            raise FileNotFoundError("no such folder")  # any failure to load is the job's
        return Renderer()

    svc = service(tmp_path, load)
    with pytest.raises(ModelLoadError, match=r"\./nope"):
        svc.switch_model("./nope")
    assert svc.model == "tiny" and isinstance(svc.runner.renderer, Renderer)
    assert loads == ["./nope", "tiny"]
    # Not remembered: its job failed once for every worker (renderfleet/jobfailure.py), and a job
    # resumed after its folder was fixed must find the model loaded afresh.
    with pytest.raises(ModelLoadError):
        svc.switch_model("./nope")
    assert loads == ["./nope", "tiny", "./nope", "tiny"]
    assert not svc.tripped
    svc.runner.close()


def test_a_revision_or_variant_is_another_model_and_no_model_key_is_loaded_twice(tmp_path: Path) -> None:
    loads: list[tuple[str, ...]] = []

    def load(model: str, revision: str, variant: str, refresh: bool) -> Renderer:
        loads.append((model, revision, variant) if not refresh else (model, revision, variant, "refresh"))
        return Renderer()

    svc = service(tmp_path, load)
    svc.use_model(RenderParams(model="tiny", scheduler="euler", loras=(("owner/l", 0.5),)))  # ours: no load
    svc.use_model(RenderParams(model="owner/m", revision="v1"))
    svc.use_model(RenderParams(model="owner/m", revision="v1", image_format="webp", loras=(("owner/l", 1.0),)))
    svc.use_model(RenderParams(model="owner/m", revision="v2"))
    svc.use_model(RenderParams(model="owner/m", revision="v2", variant="fp16"))
    svc.use_model(RenderParams(model="owner/m", revision="v2", variant="fp16", steps=3))
    assert loads == [("owner/m", "v1", ""), ("owner/m", "v2", ""), ("owner/m", "v2", "fp16")]
    assert (svc.model, svc.pin) == ("owner/m", ("v2", "fp16"))
    # a job that recorded other files than ours: loaded afresh once (our copy may be the older), then
    # refused while the files still differ, with no load more for that job's digest
    other = RenderParams(model="owner/m", revision="v2", variant="fp16", model_digest="files-sha256:" + "0" * 64)
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="changed since the job was submitted"):
            svc.use_model(other)
    assert loads[3:] == [("owner/m", "v2", "fp16", "refresh")]
    svc.runner.close()


def test_a_store_outage_while_fetching_a_model_still_gives_the_worker_its_own_back(tmp_path: Path) -> None:
    def load(model: str, *_: object) -> Renderer:
        if model == "s3://models/sdxl":
            raise StoreError("S3 503 while fetching")
        return Renderer()

    svc = service(tmp_path, load)
    with pytest.raises(StoreError):
        svc.switch_model("s3://models/sdxl")  # transient: the shard is handed back, not failed
    assert svc.model == "tiny" and isinstance(svc.runner.renderer, Renderer)
    svc.runner.close()


def test_a_refresh_cut_short_by_a_store_outage_is_tried_again_not_taken_for_changed_files(tmp_path: Path) -> None:
    digest = "s3-etags-sha256:" + "1" * 64
    outage = [True]
    loads: list[bool] = []

    def load(model: str, revision: str, variant: str, refresh: bool) -> Renderer:
        loads.append(refresh)
        if refresh and outage[0]:
            raise StoreError("S3 503 while fetching the model afresh")
        renderer = Renderer()
        renderer.loaded = SimpleNamespace(model=model, digest=digest if refresh else "")  # type: ignore[attr-defined]
        return renderer

    svc = service(tmp_path, load)
    job = RenderParams(model="tiny", model_digest=digest)
    with pytest.raises(StoreError):
        svc.use_model(job)  # transient: the shard is handed back
    outage[0] = False
    svc.use_model(job)  # the next delivery fetches afresh and renders: the files are the job's
    assert loads == [True, False, True]
    # a refresh that fails for good (the prefix emptied) is the job's error, and not tried at each delivery
    gone = RenderParams(model="tiny", model_digest="s3-etags-sha256:" + "2" * 64)
    load_error = ModelLoadError("model 'tiny': nothing found under that prefix")

    def failing(model: str, revision: str, variant: str, refresh: bool) -> Renderer:
        if refresh:
            loads.append(refresh)
            raise load_error
        return load(model, revision, variant, refresh)  # our own model back (recorded there)

    svc.load_model = failing
    with pytest.raises(ModelLoadError):
        svc.use_model(gone)
    with pytest.raises(ModelLoadError, match="changed since the job was submitted"):
        svc.use_model(gone)
    assert loads[3:] == [True, False]  # one refresh, our model back, then refused without a load
    svc.runner.close()


def test_a_worker_that_cannot_load_its_own_model_again_stops(tmp_path: Path) -> None:
    def load(model: str, *_: object) -> Renderer:
        raise RuntimeError("the model cache's disk went away")

    svc = service(tmp_path, load)
    with pytest.raises(RuntimeError, match="cannot load model 'tiny' again"):
        svc.switch_model("other")
    assert svc.tripped and svc.stop.requested
    svc.runner.close()


# ---- the device's fault: the node's, never a prompt's ---------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, ...)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    ],
)
def test_a_cuda_failure_is_a_device_error(exc: Exception) -> None:
    from worker.render.deviceerrors import is_device_error

    assert is_device_error(exc)


def test_torchs_accelerator_error_is_a_device_error_whatever_it_says() -> None:
    import torch

    from worker.render.deviceerrors import is_device_error

    assert is_device_error(torch.AcceleratorError("unspecified launch failure"))


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # halve the batch instead
        RuntimeError("CUDA error: out of memory"),
        ValueError("CUDA error: the input mentions it, but it is the input's fault"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        NotImplementedError("CUDA error: not a device fault either"),
    ],
)
def test_out_of_memory_an_input_or_a_cpu_side_error_is_not_a_device_error(exc: Exception) -> None:
    from worker.render.deviceerrors import is_device_error

    assert not is_device_error(exc)


def test_a_device_error_while_rendering_reaches_the_caller_with_nothing_counted(tmp_path: Path) -> None:
    from renderfleet.errors import DeviceError

    store = LocalStore(tmp_path / "store")
    ledger = Ledger()
    r = Renderer(DeviceError("RuntimeError: CUDA error: an illegal memory access was encountered"))
    with pytest.raises(DeviceError):
        runner(store, r).run(make_msg(), ledger)
    assert r.calls == 1  # not searched for the prompt at fault: it is none of them
    assert ledger.failures == {} and ledger.done == [] and ledger.failed == []
    assert not list(store.list("jobs/"))  # no checkpoint, no quarantine record


def test_the_renderer_turns_a_cuda_error_into_a_device_error_and_an_input_error_into_a_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from renderfleet import failpoints
    from renderfleet.errors import DeviceError
    from worker.render.pipeline import Renderer as PipelineRenderer

    class Loaded:
        model = "tiny"
        pipe = SimpleNamespace(scheduler=None)  # the pipeline's own scheduler: the call fails before it is used

    prompts = list(make_msg(n=1).prompts)
    renderer = PipelineRenderer(Loaded())  # type: ignore[arg-type]
    monkeypatch.setenv(
        failpoints.VARIABLE, "render=raise(AcceleratorError: CUDA error: an illegal memory access was encountered)"
    )
    with pytest.raises(DeviceError, match="illegal memory access"):
        renderer.render(prompts)
    monkeypatch.setenv(failpoints.VARIABLE, "render=raise(ValueError: CUDA error in a CPU-side check)")
    with pytest.raises(JobError):
        renderer.render(prompts)


def test_a_device_error_while_switching_models_is_the_nodes_not_the_jobs(tmp_path: Path) -> None:
    from renderfleet.errors import DeviceError

    loads: list[str] = []

    def load(model: str, *_: object) -> Renderer:
        loads.append(model)
        raise RuntimeError("CUDA error: device lost")

    svc = service(tmp_path, load)
    with pytest.raises(DeviceError):
        svc.switch_model("other")
    assert loads == ["other"]  # no reload of ours on a device that is gone
    svc.runner.close()


def test_a_model_too_big_for_this_card_at_a_switch_is_the_nodes_not_the_jobs(tmp_path: Path) -> None:
    from renderfleet.errors import CardTooSmall, DeviceError, ModelLoadError

    def load(model: str, *_: object) -> Renderer:
        raise CardTooSmall(f"model {model!r} does not fit this card: 33.7 GB in bf16; this card has 22.1 GB free")

    svc = service(tmp_path, load)
    with pytest.raises(CardTooSmall) as refused:
        svc.switch_model("black-forest-labs/FLUX.1-dev")
    # a DeviceError, never a ModelLoadError: the shard goes back to the front for a bigger card and this
    # worker stops (WorkerService._end), instead of the job failing for every node
    assert isinstance(refused.value, DeviceError) and not isinstance(refused.value, ModelLoadError)
    assert "22.1 GB free" in str(refused.value)
    svc.runner.close()
