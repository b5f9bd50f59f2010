"""Rendering a batch with the tiny model on the CPU: bytes, metadata, stops, errors."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from renderfleet import __version__, failpoints  # noqa: E402
from renderfleet.errors import JobError, OutOfMemory, PermanentError, PromptError, Reclaimed  # noqa: E402
from renderfleet.spec import Prompt  # noqa: E402
from worker.render.models import LoadedModel, load_pipeline  # noqa: E402
from worker.render.pipeline import Renderer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["a red fox", "a lighthouse at dusk, oil painting", "x", "héllo 世界, a long prompt"]


def make_prompt(index: int, seed: int | None = None, **changes: Any) -> Prompt:
    base = Prompt(
        index=index,
        name=f"{index:06d}",
        prompt=TEXTS[index % len(TEXTS)],
        negative_prompt="blurry",
        seed=100 + index if seed is None else seed,
        steps=2,
        guidance=7.5,
        width=32,
        height=32,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def renderer(tiny: LoadedModel) -> Renderer:
    return Renderer(tiny, batch_invariant=True)


@pytest.fixture
def unet_calls(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts denoising steps: one UNet call per step (CFG runs in one call)."""
    calls: list[int] = []
    forward = tiny.pipe.unet.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.pipe.unet, "forward", counting)
    yield calls


def test_png_is_32x32_with_the_prompt_settings_as_text(renderer: Renderer) -> None:
    p = make_prompt(3)
    [png] = renderer.render([p])
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (32, 32) and image.mode == "RGB"
    assert image.text == {  # type: ignore[attr-defined]
        "prompt": p.prompt,
        "negative_prompt": "blurry",
        "seed": str(p.seed),
        "steps": "2",
        "guidance": "7.5",
        "width": "32",
        "height": "32",
        "model": "tiny",
        "renderfleet": __version__,
        "render_config": renderer.config.digest,  # renderfleet/renderconfig.py: this process's, as rendered
    }
    assert renderer.config.device == "cpu" and renderer.config.threads == torch.get_num_threads()


def test_same_seed_same_bytes_other_seed_other_bytes(renderer: Renderer) -> None:
    first = renderer.render([make_prompt(0, seed=1)])
    again = renderer.render([make_prompt(0, seed=1)])
    other = renderer.render([make_prompt(0, seed=2)])
    assert first == again
    assert first != other


def test_an_image_has_the_same_bytes_alone_or_at_any_place_in_a_batch(
    renderer: Renderer,
) -> None:
    prompts = [make_prompt(i) for i in range(4)]
    alone = [renderer.render([p])[0] for p in prompts]
    batch_of_4 = renderer.render(prompts)
    batch_of_2 = renderer.render([prompts[3], prompts[1]])
    assert batch_of_4 == alone
    assert batch_of_2 == [alone[3], alone[1]]


def test_a_batch_of_the_same_prompts_renders_the_same_bytes_every_time(tiny: LoadedModel) -> None:
    # What the shard runner relies on in the default (batched) mode: a
    # redelivered batch has the same members in the same order.
    prompts = [make_prompt(i) for i in range(4)]
    assert Renderer(tiny).render(prompts) == Renderer(tiny).render(prompts)


def test_one_call_per_batch_is_within_a_pixel_level_of_per_prompt(tiny: LoadedModel) -> None:
    # Batched GEMMs/convolutions round differently by batch size, so the
    # single-call mode is close but not bit-exact; this pins down how close.
    prompts = [make_prompt(i) for i in range(4)]
    exact = Renderer(tiny).render(prompts)
    batched = Renderer(tiny, batch_invariant=False).render(prompts)
    for a, b in zip(exact, batched, strict=True):
        pa = np.asarray(Image.open(io.BytesIO(a)), dtype=np.int16)
        pb = np.asarray(Image.open(io.BytesIO(b)), dtype=np.int16)
        assert np.abs(pa - pb).max() <= 2


def test_the_same_bytes_come_out_of_another_process(renderer: Renderer) -> None:
    p = make_prompt(1)
    code = (
        # CPU kernels split work by thread count: the other process uses ours.
        f"import torch; torch.set_num_threads({torch.get_num_threads()});"
        "import logging, sys, tempfile; from pathlib import Path;"
        "logging.disable(logging.WARNING);"
        "from renderfleet.spec import Prompt;"
        "from worker.render.models import load_pipeline;"
        "from worker.render.pipeline import Renderer;"
        f"p = Prompt(**{dataclasses.asdict(p)!r});"
        "m = load_pipeline('tiny', device='cpu', cache_dir=Path(tempfile.mkdtemp()));"
        "sys.stdout.write(Renderer(m, batch_invariant=True).render([p])[0].hex())"  # as the fixture's
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert bytes.fromhex(result.stdout) == renderer.render([p])[0]


def test_stop_after_the_first_step_reclaims_and_skips_the_rest(renderer: Renderer, unet_calls: list[int]) -> None:
    prompts = [make_prompt(i, steps=4) for i in range(2)]
    with pytest.raises(Reclaimed, match="mid-batch"):
        renderer.render(prompts, should_stop=lambda: len(unet_calls) >= 1)
    assert len(unet_calls) == 1  # of the 8 steps the batch needs


def test_stop_flag_already_set_renders_nothing(renderer: Renderer, unet_calls: list[int]) -> None:
    with pytest.raises(Reclaimed):
        renderer.render([make_prompt(0)], should_stop=lambda: True)
    assert unet_calls == []


def test_a_stop_in_single_call_mode_interrupts_the_pipeline(tiny: LoadedModel, unet_calls: list[int]) -> None:
    prompts = [make_prompt(i, steps=4) for i in range(2)]
    with pytest.raises(Reclaimed, match="mid-batch"):
        Renderer(tiny, batch_invariant=False).render(prompts, should_stop=lambda: len(unet_calls) >= 1)
    assert len(unet_calls) == 1


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_stop_after_the_last_step_skips_the_decode(
    tiny: LoadedModel, unet_calls: list[int], monkeypatch: pytest.MonkeyPatch, batch_invariant: bool
) -> None:
    # The decode is part of finishing a batch (at a large size on a CPU it costs more than a step):
    # a stop that says the batch cannot finish in time, seen after its last step, skips it.
    decodes: list[int] = []
    decode = tiny.pipe.vae.decode
    monkeypatch.setattr(tiny.pipe.vae, "decode", lambda *a, **k: decodes.append(1) or decode(*a, **k))
    prompts = [make_prompt(i) for i in range(2)]  # 2 steps each
    steps = 4 if batch_invariant else 2
    with pytest.raises(Reclaimed, match="mid-batch"):
        Renderer(tiny, batch_invariant=batch_invariant).render(prompts, should_stop=lambda: len(unet_calls) >= steps)
    assert len(unet_calls) == steps and len(decodes) == (1 if batch_invariant else 0)


def test_a_stop_asked_only_after_the_call_keeps_the_finished_batch(renderer: Renderer) -> None:
    prompts = [make_prompt(i) for i in range(2)]
    asked: list[int] = []
    images = renderer.render(prompts, should_stop=lambda: bool(asked.append(1)))
    assert images == renderer.render(prompts) and len(asked) == 1 + 2 * 2 + 1  # start, every step, between prompts


def test_every_denoising_step_reaches_the_step_failpoint_before_its_stop_is_asked(
    renderer: Renderer, unet_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a test slows with step=sleep(S) (tests/integration/test_no_orphans.py): each step, and a stop
    # told during the sleep still ends the batch at that step.
    slept: list[int] = []
    monkeypatch.setattr(failpoints, "_reached", {})
    monkeypatch.setattr(failpoints.time, "sleep", lambda seconds: slept.append(len(unet_calls)))
    monkeypatch.setenv(failpoints.VARIABLE, "step=sleep(0.5)")
    renderer.render([make_prompt(i, steps=3) for i in range(2)])
    assert slept == [1, 2, 3, 4, 5, 6]  # after every step's UNet call, none more
    slept.clear()
    unet_calls.clear()
    with pytest.raises(Reclaimed, match="mid-batch"):
        renderer.render([make_prompt(0, steps=3)], should_stop=lambda: bool(slept))
    assert slept == [1] and len(unet_calls) == 1


def test_prompts_with_different_render_keys_are_refused(renderer: Renderer) -> None:
    with pytest.raises(ValueError, match="000001"):
        renderer.render([make_prompt(0), make_prompt(1, steps=3)])
    with pytest.raises(ValueError, match="empty"):
        renderer.render([])
    with pytest.raises(ValueError, match="multiples of 8"):
        renderer.render([make_prompt(0, width=30)])


def test_out_of_memory_is_reported_as_such(renderer: Renderer, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(tiny.pipe.unet, "forward", oom)
    with pytest.raises(OutOfMemory):
        renderer.render([make_prompt(0)])


def test_any_other_failure_is_permanent_and_chained(
    renderer: Renderer, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("index 99 is out of bounds")

    monkeypatch.setattr(tiny.pipe.unet, "forward", broken)
    with pytest.raises(PermanentError, match="index 99") as info:
        renderer.render([make_prompt(0)])
    assert isinstance(info.value.__cause__, IndexError)
    assert not isinstance(info.value, (JobError, PromptError))  # the node's fault until proven otherwise


def test_timings_are_measured(renderer: Renderer) -> None:
    renderer.render([make_prompt(i) for i in range(2)])
    assert renderer.last_batch_seconds > 0


def test_settings_the_pipeline_rejects_are_the_jobs_fault(
    renderer: Renderer, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("`height` and `width` have to be divisible by 64")

    monkeypatch.setattr(tiny.pipe.unet, "forward", refuses)
    with pytest.raises(JobError, match="the model rejects these settings: `height`"):
        renderer.render([make_prompt(0)])


def test_a_prompt_whose_image_cannot_be_encoded_is_that_prompts_fault(
    renderer: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.render import pipeline as render

    real = render.images.encode

    def encode(image: Any, fmt: str, quality: int, metadata: dict[str, str]) -> bytes:
        if metadata["prompt"] == make_prompt(1).prompt:
            raise ValueError("embedded null byte")
        return real(image, fmt, quality, metadata)

    monkeypatch.setattr(render.images, "encode", encode)
    with pytest.raises(PromptError, match="'000001'") as info:
        renderer.render([make_prompt(0), make_prompt(1)])
    assert not isinstance(info.value, JobError)


def test_the_vae_memory_modes_are_set_per_call_on_cuda_and_never_on_the_cpu(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.render import pipeline as render

    calls: list[tuple[bool, bool]] = []
    monkeypatch.setattr(render, "set_vae_memory_modes", lambda pipe, slicing, tiling: calls.append((slicing, tiling)))
    Renderer(tiny).render([make_prompt(0)])
    assert calls == []  # the CPU path: the VAE as it was
    # the same pipeline labelled as on a card: its decisions, taken per call (the pipeline still runs here)
    monkeypatch.setattr(render, "vae_memory_modes", lambda device, w, h, n: (n >= 2, w > 16))
    on_card = Renderer(dataclasses.replace(tiny, device="cuda"))
    on_card.render([make_prompt(0)])
    on_card.render([make_prompt(0), make_prompt(1)])
    assert calls == [(False, True), (True, True)]


# ---- errors classed by what they say about the device, and memory handed back ---------------------------------------


class StableDiffusionPipeline:
    """A pipeline stand-in for a card the CPU does not have: returns flat images (dark grey, not
    black: a black one is refused), or raises ``fail``.  Named as SD's pipeline: the renderer
    serves it as that family (worker/render/models/families)."""

    def __init__(self, fail: Callable[[], BaseException] | None = None) -> None:
        self.fail = fail

    def __call__(self, prompt: list[str], **kwargs: Any) -> Any:
        activations = {"tensors": Activations()}
        activations["cycle"] = activations  # frames and tensors in a cycle: freed by the collector only
        if self.fail is not None:
            raise self.fail()
        return type("Output", (), {"images": [Image.new("RGB", (8, 8), (1, 1, 1)) for _ in prompt]})()


FakePipe = StableDiffusionPipeline


class Activations:
    """What a failed call's frames hold on to: on a card, gigabytes."""


def on_card(pipe: Any) -> Renderer:
    return Renderer(LoadedModel(pipe=pipe, model="fake", device="cuda", dtype=torch.float16, load_seconds=0.0))


@pytest.fixture
def mocked_card(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda's memory calls, recorded: this CPU build has no card."""
    import gc
    import weakref

    calls: list[str] = []
    live: list[weakref.ref[Activations]] = []
    original = Activations.__init__

    def track(self: Activations) -> None:
        original(self)
        live.append(weakref.ref(self))

    def empty_cache() -> None:
        alive = [r for r in live if r() is not None]
        calls.append(f"empty_cache with {len(alive)} failed call's activations alive")

    monkeypatch.setattr(Activations, "__init__", track)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset_peak"))
    gc.collect()
    return calls


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUDA out of memory. Tried to allocate 2.00 GiB",
    ],
)
def test_a_library_that_could_not_allocate_is_out_of_memory_so_the_batch_is_halved(
    text: str, renderer: Renderer, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.render.deviceerrors import is_device_error, is_out_of_memory

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(text)

    assert is_out_of_memory(RuntimeError(text)) and not is_device_error(RuntimeError(text))
    monkeypatch.setattr(tiny.pipe.unet, "forward", fails)
    with pytest.raises(OutOfMemory, match="out of memory rendering 1 prompts at 32x32"):
        renderer.render([make_prompt(0)])


def test_other_cublas_and_cuda_failures_stay_device_errors() -> None:
    from worker.render.deviceerrors import is_device_error, is_out_of_memory

    for text in (
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`",
        "CUDA error: an illegal memory access was encountered",
    ):
        assert is_device_error(RuntimeError(text)) and not is_out_of_memory(RuntimeError(text))
    assert not is_device_error(ValueError("CUDA error: quoted in an input"))  # an input's text, not the device


def test_a_device_error_raised_while_compiling_is_the_devices_not_the_prompts(
    renderer: Renderer, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.exc import BackendCompilerFailed

    from renderfleet.errors import DeviceError
    from worker.render.deviceerrors import is_device_error, is_out_of_memory

    def compile_failed(inner: Exception) -> BackendCompilerFailed:
        try:  # as dynamo raises it: the backend's error inside, and chained
            raise inner
        except Exception as exc:
            try:
                raise BackendCompilerFailed(lambda: None, exc, None) from exc
            except BackendCompilerFailed as wrapped:
                return wrapped

    lost = compile_failed(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(lost)
    assert is_out_of_memory(compile_failed(torch.cuda.OutOfMemoryError("CUDA out of memory")))
    assert not is_device_error(compile_failed(IndexError("a bug in a lowering")))

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise lost

    monkeypatch.setattr(tiny.pipe.unet, "forward", forward)
    with pytest.raises(DeviceError):
        renderer.render([make_prompt(0)])


def test_a_cause_chain_that_loops_is_followed_once() -> None:
    from worker.render.deviceerrors import is_device_error

    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert not is_device_error(a)


def test_after_an_out_of_memory_the_cache_is_emptied_only_once_the_failed_call_is_released_mocked_device(
    mocked_card: list[str],
) -> None:
    renderer = on_card(FakePipe(fail=lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate")))
    with pytest.raises(OutOfMemory) as info:
        renderer.render_images([make_prompt(0), make_prompt(1)])
    assert mocked_card == ["reset_peak", "empty_cache with 0 failed call's activations alive"]
    assert info.value.__cause__ is None and info.value.__context__ is None  # nothing holds the frames
    assert "Tried to allocate" in str(info.value)


def test_each_batch_starts_the_cards_memory_peak_afresh_but_a_probe_does_not_mocked_device(mocked_card: list[str]) -> None:
    renderer = on_card(FakePipe())
    renderer.generate([make_prompt(0)], output_type="pt")  # a batch-size probe or a benchmark's call
    assert mocked_card == []
    renderer.render_images([make_prompt(0)])
    renderer.render([make_prompt(0), make_prompt(1)])
    assert mocked_card == ["reset_peak", "reset_peak"]
    Renderer(dataclasses.replace(on_card(FakePipe()).loaded, device="cpu")).render_images([make_prompt(0)])
    assert mocked_card == ["reset_peak", "reset_peak"]  # the CPU has no card peak
