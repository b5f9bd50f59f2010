"""The output path (issue 48, item 2): a pipeline's pixels are checked, scaled and made 8-bit on their
own device, only the 8 bits cross to the host, and the PIL image is made in the encode pool; the
images keep the bytes diffusers' own ``pt_to_numpy`` / ``numpy_to_pil`` conversion gives them.

Bytes are compared at one thread: a reduction's order may differ between calls at more."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import numpy as np  # noqa: E402
from diffusers.image_processor import VaeImageProcessor  # noqa: E402
from PIL import Image  # noqa: E402

from renderfleet.families import TINY_MODELS  # noqa: E402
from renderfleet.spec import Prompt  # noqa: E402
from renderfleet.store import LocalStore  # noqa: E402
from tests.unit.test_tiny_families import one_thread  # noqa: E402, F401  (autouse: bytes compared at one thread)
from worker.node.stop import StopSignal  # noqa: E402
from worker.render import outputs  # noqa: E402
from worker.render.models import LoadedModel, load_pipeline  # noqa: E402
from worker.render.pipeline import Renderer  # noqa: E402
from worker.render.runner import ShardRunner  # noqa: E402

FAMILIES = ["tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-flux-schnell"]


def old_uint8(pixels: np.ndarray) -> np.ndarray:
    """diffusers' own arithmetic (``VaeImageProcessor.numpy_to_pil``) on float32 numpy."""
    return np.stack([np.asarray(image) for image in VaeImageProcessor.numpy_to_pil(pixels)])


# ---- the arithmetic ------------------------------------------------------------------------------


def test_eight_bits_made_in_torch_equal_numpy_to_pil_at_every_value_and_every_half_way_point() -> None:
    rng = np.random.default_rng(48)
    # Every value that lands on k + 0.5 after the float32 multiply (round half to even decides it), its
    # neighbours one ulp either side, each k / 255 and its neighbours, 0, 1, and a million random values.
    halves = ((np.arange(256, dtype=np.float64) + 0.5) / 255).astype(np.float32)
    steps = (np.arange(256, dtype=np.float64) / 255).astype(np.float32)
    exact = np.array([k + 0.5 for k in range(255)], dtype=np.float32) / np.float32(255)
    edges = np.concatenate([halves, steps, exact])
    values = np.concatenate(
        [
            edges,
            np.nextafter(edges, np.float32(0)),
            np.nextafter(edges, np.float32(1)),
            np.array([0.0, 1.0], dtype=np.float32),
            rng.random(1_000_000, dtype=np.float32),
        ]
    )
    values = np.clip(values, 0, 1)  # what the image processor's clamp leaves
    on_the_half = (values.astype(np.float32) * np.float32(255)) % 1 == 0.5
    assert on_the_half.sum() > 50  # the ties are really tested
    pixels = values[: values.size // 3 * 3].reshape(1, -1, 1, 3)  # one image, (1, W, 3)
    ours = outputs.to_uint8(torch.from_numpy(pixels).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
    assert ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, old_uint8(pixels))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_vae_s_pixels_are_made_float32_first_as_pt_to_numpy_does(dtype: torch.dtype) -> None:
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    old = old_uint8(VaeImageProcessor.pt_to_numpy(pixels))
    np.testing.assert_array_equal(outputs.to_uint8(pixels).permute(0, 2, 3, 1).numpy(), old)


# ---- the check, on the device ----------------------------------------------------------------------


class Output:
    def __init__(self, images: Any, nsfw: list[bool] | None = None) -> None:
        self.images = images
        self.nsfw_content_detected = nsfw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


def test_a_tensor_with_one_nan_or_all_black_is_bad_a_dark_or_flagged_one_is_not_and_8_bits_come_back(
    tiny: LoadedModel,
) -> None:
    pixels = torch.full((5, 3, 4, 6), 0.5, dtype=torch.bfloat16)
    pixels[0, 1, 2, 3] = float("nan")  # one value
    pixels[1] = 0.0  # black
    pixels[2] = 0.0
    pixels[2, 2, 0, 0] = 1 / 255  # dark: one value at 1 of 255, an image
    pixels[3] = 0.0  # the safety checker's black: its decision
    checked = outputs.check(tiny.pipe, Output(pixels, [False, False, False, True, False]))
    assert checked.bad == {0: outputs.NOT_FINITE, 1: outputs.BLACK}
    assert all(type(image) is outputs.Pixels for image in checked)
    assert all(image.array.dtype == np.uint8 and image.array.shape == (4, 6, 3) for image in checked)
    assert checked[4].size == (6, 4) and outputs.to_pil(checked[4]).size == (6, 4)
    assert outputs.is_black(checked[1]) and not outputs.is_black(checked[2])
    single = outputs.check(tiny.pipe, Output(torch.full((1, 1, 2, 2), 0.25)))  # one band: "L", as numpy_to_pil
    assert outputs.to_pil(single[0]).mode == "L" and single.bad == {}


def test_the_pipeline_is_asked_for_its_pixel_tensor_and_only_8_bits_reach_the_host(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    call = type(tiny.pipe).__call__

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["output_type"])
        return call(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny.pipe), "__call__", spy)
    prompt = Prompt(0, "000000", "a red fox", "", 1, 2, 7.5, 32, 32)
    [image] = Renderer(tiny).render_images([prompt])
    assert asked == ["pt"]
    assert type(image) is outputs.Pixels and image.array.dtype == np.uint8 and image.array.shape == (32, 32, 3)


# ---- the same bytes as before, each family -----------------------------------------------------------


def prompts(model: str) -> list[Prompt]:
    guidance = TINY_MODELS[model].guidance_scale if model in TINY_MODELS else 7.5
    base = Prompt(0, "000000", "a red fox", "", 0, 2, guidance, 32, 32)
    return [
        dataclasses.replace(base, index=i, name=f"{i:06d}", prompt=text, seed=100 + i)
        for i, text in enumerate(["a red fox", "a lighthouse at dusk", "x"])
    ]


@pytest.mark.parametrize("model", FAMILIES)
def test_each_family_s_images_keep_the_png_bytes_of_diffusers_own_pil_conversion(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    renderer = Renderer(load_pipeline(model, device="cpu", cache_dir=Path("/nonexistent")))
    batch = prompts(model)
    new = renderer.render_images(batch)
    assert all(type(image) is outputs.Pixels for image in new)  # nothing PIL on the render thread
    # Before: the pipeline's own conversion (pt_to_numpy, then numpy_to_pil: what "pil" asks of diffusers).
    monkeypatch.setattr(outputs, "ask_for", lambda pipe, output_type: output_type)
    old = renderer.render_images(batch)
    assert all(isinstance(image, Image.Image) for image in old)
    for a, b, p in zip(new, old, batch, strict=True):
        assert a.tobytes() == b.tobytes()
        assert renderer.encode(a, p) == renderer.encode(b, p)


# ---- PIL made in the encode pool -------------------------------------------------------------------


def test_the_runner_makes_pil_images_on_its_upload_threads_not_the_render_thread(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.unit.test_work_faults import Ledger, make_msg

    made_on: list[str] = []
    to_pil = outputs.Pixels.to_pil

    def recorded(self: outputs.Pixels) -> Any:
        made_on.append(threading.current_thread().name)
        return to_pil(self)

    monkeypatch.setattr(outputs.Pixels, "to_pil", recorded)
    store = LocalStore(tmp_path / "store")
    ledger = Ledger()
    shards = ShardRunner(store=store, renderer=Renderer(tiny), stop=StopSignal(), max_failures=3)
    shards.run(make_msg(n=2), ledger)
    assert len(ledger.done) == 2
    assert len(made_on) == 2 and all(name.startswith("rf-upload") for name in made_on), made_on
