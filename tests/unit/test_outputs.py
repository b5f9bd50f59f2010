"""A black image is not a success: NaN, inf or all-black images are rendered again once with the
VAE in float32, and refused (BadOutput, a device error) if still bad; never stored, never blamed on
a prompt.  The tiny model on the CPU, its VAE's decode patched to give what a failing card gives."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from renderfleet.errors import BadOutput, DeviceError  # noqa: E402
from renderfleet.spec import Prompt  # noqa: E402
from renderfleet.store import LocalStore  # noqa: E402
from worker.accounting.metrics import BadImages  # noqa: E402
from worker.node.stop import StopSignal  # noqa: E402
from worker.render import outputs  # noqa: E402
from worker.render.models import LoadedModel, build_tiny_pipeline, load_pipeline  # noqa: E402
from worker.render.pipeline import Renderer, encode_image  # noqa: E402
from worker.render.runner import ShardRunner  # noqa: E402


def make_prompt(index: int, **changes: Any) -> Prompt:
    base = Prompt(
        index=index,
        name=f"{index:06d}",
        prompt=["a red fox", "a lighthouse at dusk", "x"][index % 3],
        negative_prompt="blurry",
        seed=100 + index,
        steps=2,
        guidance=7.5,
        width=32,
        height=32,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


class Heard:
    """The renderer's ``on_bad_images`` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[BadImages, int]] = []

    def __call__(self, outcome: BadImages, n: int) -> None:
        self.calls.append((outcome, n))


def poison_decode(pipe: Any, monkeypatch: pytest.MonkeyPatch, bad: Callable[[int, Any], list[int]]) -> list[torch.dtype]:
    """The VAE's decode, its rows ``bad(call, z)`` made NaN (as an fp16 overflow makes them); the
    VAE's dtype at each call is recorded."""
    decode = pipe.vae.decode
    seen: list[torch.dtype] = []

    def poisoned(z: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(pipe.vae.dtype)
        rows = bad(len(seen), z)
        if rows and pipe.vae.dtype != torch.float32:
            # A VAE not in float32 would refuse these float32 latents: what it gives is made up here.
            return (torch.full((z.shape[0], 3, z.shape[2] * 2, z.shape[3] * 2), float("nan")),)
        sample = decode(z, *args, **kwargs)[0].clone()
        sample[rows] = float("nan")
        return (sample,)

    monkeypatch.setattr(pipe.vae, "decode", poisoned)
    return seen


# ---- the check itself -------------------------------------------------------------------


class Output:
    def __init__(self, images: Any, nsfw: list[bool] | None = None) -> None:
        self.images = images
        self.nsfw_content_detected = nsfw


def test_one_nan_pixel_or_an_all_black_image_is_bad_and_a_dark_or_flagged_one_is_not(tiny: LoadedModel) -> None:
    pixels = np.full((5, 4, 4, 3), 0.5, dtype=np.float32)
    pixels[0, 2, 1, 0] = np.nan  # one pixel
    pixels[1] = 0.0  # black
    pixels[2] = 0.0
    pixels[2, 0, 0, 2] = 1 / 255  # dark, one pixel at 1: an image
    pixels[3] = 0.0  # the safety checker's black: its decision, not a fault
    checked = outputs.check(tiny.pipe, Output(pixels, [False, False, False, True, False]))
    assert checked.bad == {0: outputs.NOT_FINITE, 1: outputs.BLACK}
    assert all(isinstance(outputs.to_pil(image), Image.Image) for image in checked)
    # PIL images (a pipeline without diffusers' image processor): the black check alone.
    assert outputs.check(None, Output([Image.new("RGB", (4, 4)), Image.new("RGB", (4, 4), (0, 0, 1))])).bad == {
        0: outputs.BLACK
    }
    assert outputs.is_black(Image.new("RGBA", (4, 4), (0, 0, 0, 255)))
    assert outputs.is_black(Image.new("L", (4, 4))) and not outputs.is_black(Image.new("L", (4, 4), 3))


def test_a_pil_call_asks_the_pipeline_for_its_pixel_tensor_and_other_calls_as_asked(tiny: LoadedModel) -> None:
    assert outputs.ask_for(tiny.pipe, "pil") == "pt"
    assert outputs.ask_for(tiny.pipe, "pt") == "pt"
    assert outputs.ask_for(object(), "pil") == "pil"


# ---- (c) a normal render keeps its bytes --------------------------------------------------


def test_a_good_render_has_the_bytes_of_a_plain_pil_call_of_the_pipeline(tiny: LoadedModel) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [make_prompt(i) for i in range(3)]
        heard = Heard()
        ours = Renderer(tiny, on_bad_images=heard).render_images(prompts)  # one call: the batch
        # What the renderer did before the check: one call of the pipeline for PIL images.
        plain = tiny.pipe(
            prompt=[p.prompt for p in prompts],
            negative_prompt=[p.negative_prompt for p in prompts],
            num_inference_steps=2,
            guidance_scale=7.5,
            width=32,
            height=32,
            generator=[torch.Generator("cpu").manual_seed(p.seed) for p in prompts],
            output_type="pil",
        ).images
    finally:
        torch.set_num_threads(threads)
    assert heard.calls == []
    for a, b, p in zip(ours, plain, prompts, strict=True):
        a = outputs.to_pil(a)  # the renderer's 8-bit pixels, made PIL where they are encoded
        assert type(a) is type(b) and a.mode == b.mode and a.size == b.size
        assert a.tobytes() == b.tobytes()
        assert encode_image(a, p, "tiny") == encode_image(b, p, "tiny")


# ---- (a) a once-bad image is rendered again -----------------------------------------------


def test_a_once_bad_image_is_rendered_again_alone_and_the_good_one_returned(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = [make_prompt(i) for i in range(3)]
    clean = Renderer(tiny).render(prompts)
    alone = Renderer(tiny).render([prompts[1]])[0]  # what a call of prompt 1 alone renders
    seen = poison_decode(tiny.pipe, monkeypatch, lambda call, z: [1] if call == 1 else [])
    heard = Heard()
    with caplog.at_level(logging.WARNING, logger="worker.render.pipeline"):
        again = Renderer(tiny, on_bad_images=heard).render(prompts)
    assert len(seen) == 2  # the batch, then prompt 1 alone
    assert again == [clean[0], alone, clean[2]]
    assert heard.calls == [(BadImages.RERENDERED, 1)]
    [line] = [r.getMessage() for r in caplog.records if "rendered again" in r.getMessage()]
    assert "000001" in line and "NaN" in line and "000000" not in line


def test_a_bad_decode_in_fp16_is_rendered_again_with_the_vae_upcast_to_float32_and_put_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = build_tiny_pipeline()  # its own: its VAE's weights go through bfloat16
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.to(dtype=torch.bfloat16)  # as on a card; bfloat16, since a CPU has no fp16 convolutions
    loaded = LoadedModel(pipe=pipe, model="tiny", device="cpu", dtype=torch.float32, load_seconds=0.0)
    seen = poison_decode(pipe, monkeypatch, lambda call, z: [0] if pipe.vae.dtype != torch.float32 else [])
    ours = pipe.vae.decode
    heard = Heard()
    with caplog.at_level(logging.WARNING, logger="worker.render.pipeline"):
        [image] = Renderer(loaded, on_bad_images=heard).render_images([make_prompt(0)])
    assert seen == [torch.bfloat16, torch.float32]  # the call as loaded, then the one upcast
    assert not outputs.is_black(image) and heard.calls == [(BadImages.RERENDERED, 1)]
    assert "VAE upcast to float32" in caplog.text and "000000" in caplog.text
    assert pipe.vae.dtype == torch.bfloat16 and pipe.vae.decode == ours  # put back as it was


def test_the_vae_is_put_back_even_when_the_upcast_call_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    class Vae(torch.nn.Conv2d):
        dtype = property(lambda self: self.weight.dtype)  # as diffusers' models have it

        def decode(self, z: Any) -> Any:
            return z

    vae = Vae(1, 1, 1).to(torch.bfloat16)
    ours = vae.decode
    pipe = type("Pipe", (), {"vae": vae})()
    with pytest.raises(RuntimeError, match="boom"), outputs.vae_in_float32(pipe) as upcast:
        assert upcast and vae.weight.dtype == torch.float32
        assert vae.decode(torch.zeros(1, dtype=torch.bfloat16)).dtype == torch.float32
        raise RuntimeError("boom")
    assert vae.weight.dtype == torch.bfloat16 and vae.decode == ours and "decode" not in vars(vae)


# ---- (b) an always-bad image is refused -----------------------------------------------------


def test_an_always_bad_image_raises_bad_output_a_device_error_and_returns_none(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = poison_decode(tiny.pipe, monkeypatch, lambda call, z: list(range(z.shape[0])))
    heard = Heard()
    returned: list[Any] = []
    with pytest.raises(BadOutput, match="000001: NaN or inf values") as info:
        returned = Renderer(tiny, on_bad_images=heard).render([make_prompt(0), make_prompt(1)])
    assert isinstance(info.value, DeviceError) and returned == []
    assert len(seen) == 2 and heard.calls == [(BadImages.REFUSED, 2)]


def test_a_refused_batch_stores_nothing_and_counts_nothing_against_its_prompts(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.unit.test_work_faults import Ledger, make_msg

    poison_decode(tiny.pipe, monkeypatch, lambda call, z: list(range(z.shape[0])))
    store = LocalStore(tmp_path / "store")
    ledger = Ledger()
    shards = ShardRunner(store=store, renderer=Renderer(tiny), stop=StopSignal(), max_failures=3)
    with pytest.raises(BadOutput):  # the worker's device-error path: shard handed back, worker stops
        shards.run(make_msg(n=2), ledger)
    assert ledger.failures == {} and ledger.done == [] and ledger.failed == []
    assert not list(store.list("jobs/"))  # no image, no checkpoint, no quarantine record
