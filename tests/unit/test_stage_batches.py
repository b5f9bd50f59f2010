"""Batch sizes per stage and latents between stages (issue 39, items 4 and 2): each stage's size probed
and remembered per (card, model, size, stage) beside generate's records (old ones read as before), an
out-of-memory halving one stage's size alone, and SDXL's base handing its refiner latents stored as
safetensors, byte-identical across retries and resumed from as from a PNG."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from renderfleet import spec
from renderfleet import stages as stagelib
from renderfleet.errors import OutOfMemory
from renderfleet.spec import Prompt, RenderParams, ShardMessage
from renderfleet.stages import Stage, hands_latents, next_stage, parse_refine, parse_upscale
from renderfleet.store import LocalStore
from worker.render.batchsize import KEY_PREFIX, BatchSizes
from worker.render.stagerun import ShardStages

# ---- fakes: a card that runs out of memory over a size ------------------------------------------------


@dataclasses.dataclass
class Loaded:
    model: str
    device: str = "cuda"
    compiled: bool = False


class Generate:
    """Generate on a fake card (a render renders ``fits`` prompts at most)."""

    def __init__(self, fits: int) -> None:
        self.loaded = Loaded("m")
        self.fits = fits
        self.calls: list[int] = []

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[Any]:
        self.calls.append(len(prompts))
        if len(prompts) > self.fits:
            raise OutOfMemory(f"fake: {len(prompts)} > {self.fits}")
        return [Image.new("RGB", (p.width, p.height), (p.index, 0, 0)) for p in prompts]


class Stager:
    """A stage on a fake card: a call of more than ``fits`` images runs out of memory; ``log`` hears every
    call as (stage index, size), probes included."""

    def __init__(self, stage: Stage, index: int, fits: int, log: list[tuple[int, int]], device: str = "cuda") -> None:
        self.stage, self.index, self.fits, self.log, self.device = stage, index, fits, log, device
        upscale = stage.kind == stagelib.UPSCALE
        self.batch_key = ("x4", f"upscale-x{stage.factor}") if upscale else ("m", stage.kind)  # as StageRenderer's

    def pixel_size(self, image: Any) -> tuple[int, int]:
        return image.size  # type: ignore[no-any-return]

    def run(self, images: list[Any], prompts: Sequence[Prompt], *, should_stop: Callable[[], bool], **_: Any) -> list[Any]:
        self.log.append((self.index, len(images)))
        if len(images) > self.fits:
            raise OutOfMemory(f"fake: {len(images)} > {self.fits} in stage {self.index + 1}")
        return [image.resize((image.width * self.stage.factor, image.height * self.stage.factor)) for image in images]


def card(device: str) -> str:
    return "Fake H200"


def prompts(n: int, size: int = 16, **extra: Any) -> list[Prompt]:
    return [
        Prompt(i, spec.index_name(i), f"p{i}", "", spec.derive_seed(0, i), 2, 7.5, size, size, **extra) for i in range(n)
    ]


def record(store: LocalStore, key: tuple[Any, ...]) -> dict[str, Any]:
    data = store.get(BatchSizes.store_key(key))
    assert data is not None, key
    return dict(json.loads(data))


# ---- batch sizes per stage --------------------------------------------------------------------------


def test_each_stage_is_probed_once_and_remembered_per_stage_beside_generates_old_records(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    # A record generate's search wrote before stages: no stage field, its key as it always was.
    old = {"size": 6, "limit": 8, "oom": True, "how": "probe", "card": "Fake H200", "model": "m", "width": 16, "height": 16}
    store.put(BatchSizes.store_key(("Fake H200", "m", 16, 16)), json.dumps(old).encode())
    gpu = Generate(fits=99)
    assert BatchSizes(store, card=card).size_for(gpu, prompts(1)[0], 8) == 6 and gpu.calls == []  # read, no probe

    log: list[tuple[int, int]] = []
    upscale = Stager(parse_upscale("4:tiny-x4-upscaler"), 0, fits=3, log=log)
    refine = Stager(parse_refine("self:0.5"), 1, fits=5, log=log)
    sizes = BatchSizes(store, card=card)
    sample = Image.new("RGB", (16, 16))
    assert sizes.stage_size_for(upscale, prompts(1)[0], sample, 8) == 3  # 1, 2, 4 (out), 3
    assert log == [(0, 1), (0, 2), (0, 4), (0, 3)]
    assert sizes.stage_size_for(refine, prompts(1)[0], sample, 8) == 4  # 5 fit, 6 did not: less the margin
    log.clear()
    # Another worker of the card reads both without a probe; generate's record is as it was.
    again = BatchSizes(store, card=card)
    assert again.stage_size_for(upscale, prompts(1)[0], sample, 8) == 3
    assert again.stage_size_for(refine, prompts(1)[0], sample, 8) == 4 and log == []
    assert record(store, ("Fake H200", "x4", 16, 16, "upscale-x4"))["stage"] == "upscale-x4"
    assert record(store, ("Fake H200", "m", 16, 16, "refine"))["size"] == 4
    assert record(store, ("Fake H200", "m", 16, 16)) == old
    assert len(list(store.list(KEY_PREFIX))) == 3
    # On a CPU, or with a fixed size, a stage runs the whole batch (or the fixed size): nothing probed.
    on_cpu = Stager(parse_refine("self:0.5"), 1, fits=1, log=log, device="cpu")
    assert BatchSizes(store, card=card).stage_size_for(on_cpu, prompts(1)[0], sample, 8) == 8
    assert BatchSizes(store, fixed=2, card=card).stage_size_for(refine, prompts(1)[0], sample, 8) == 2 and log == []


def test_an_out_of_memory_in_a_stage_halves_that_stage_alone_and_the_batch_is_whole_before_the_next(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "store")
    sizes = BatchSizes(store, card=card)
    stages = (parse_upscale("4:tiny-x4-upscaler"), parse_refine("self:0.5"))
    log: list[tuple[int, int]] = []
    fits = {0: 2, 1: 8}
    shard = ShardStages(store, lambda stage, index: Stager(stage, index, fits[index], log), batch_sizes=sizes)
    # The upscale's record says 8 fit there once (another card's driver, say): this card fits 2.
    for index, stage_part in ((0, "upscale-x4"), (1, "refine")):
        key = ("Fake H200", "x4" if index == 0 else "m", 16 if index == 0 else 64, 16 if index == 0 else 64, stage_part)
        known = {"size": 8, "limit": 8, "oom": False, "how": "probe", "card": key[0], "model": key[1]}
        store.put(BatchSizes.store_key(key), json.dumps({**known, "width": key[2], "height": key[3]}).encode())
    msg = ShardMessage(job="j", shard=0, params=RenderParams(model="m", stages=stages), batch_size=8, queue="q")
    batch = prompts(8)
    made = {p.name: Image.new("RGB", (16, 16), (p.index, 0, 0)) for p in batch}
    failures: list[Any] = []
    finals = shard.run(msg, object(), batch, made, {}, failures, lambda: False)

    assert failures == [] and sorted(finals) == [p.name for p in batch]
    assert all(image.size == (64, 64) for image in finals.values())
    # The upscale: 8 ran out, then calls of 4 (out) and of 2; the whole level made before the refine's one call of 8.
    assert log == [(0, 8), (0, 4), (0, 2), (0, 2), (0, 2), (0, 2), (1, 8)]
    assert record(store, ("Fake H200", "x4", 16, 16, "upscale-x4"))["size"] == 2  # halved and remembered
    assert record(store, ("Fake H200", "m", 64, 64, "refine"))["size"] == 8  # the refine's as it was
    assert store.get(BatchSizes.store_key(("Fake H200", "m", 16, 16))) is None  # generate's untouched


# ---- latents between stages: the rule --------------------------------------------------------------


def test_latents_go_to_a_refine_of_the_same_latent_space_and_images_everywhere_else() -> None:
    refine, upscale = parse_refine("tiny-sdxl-refiner"), parse_upscale("2")
    assert hands_latents(None, refine, "sdxl", "sdxl")  # SDXL's base to its refiner
    assert hands_latents(None, parse_refine("self"), "sd", "sd")  # the job's own model at the same size
    assert hands_latents(refine, parse_refine("self"), "sdxl", "sdxl")  # refine to refine
    assert not hands_latents(None, refine, "sd", "sdxl")  # another family: another latent space
    assert not hands_latents(None, parse_refine("self"), "flux", "flux")  # packed latents: images
    assert not hands_latents(None, parse_refine("self"), "", "")  # unknown
    assert not hands_latents(None, upscale, "sdxl", "sdxl")  # an upscale takes images
    assert not hands_latents(upscale, refine, "sdxl", "sdxl")  # ... and makes them
    assert not hands_latents(refine, None, "sdxl", "sdxl")  # a final is an image
    # A prompt that skips a stage hands its image to the next it goes through.
    three = (refine, upscale, refine)
    assert next_stage(three, "", -1) == 0 and next_stage(three, "1", -1) == 1 and next_stage(three, "2", 0) == 2
    assert next_stage(three, "3", 1) is None
    assert spec.stage_key("j", 0, 0, "000001", "l", latents=True).endswith("/0/000001.safetensors")
    assert spec.stage_key("j", 0, 1, "000001", "l").endswith("/1/000001.png")


# ---- latents between stages: SDXL's tiny base and refiner ---------------------------------------------


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bytes compared: one reduction order
    yield
    torch.set_num_threads(threads)


class Ledger:
    def __init__(self) -> None:
        self.stages: list[tuple[str, int]] = []

    def check(self) -> None: ...

    def life_ended(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None: ...
    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None: ...
    def record_failure(self, prompt: Prompt, error: str) -> int:
        raise AssertionError(f"{prompt.name} failed: {error}")

    def record_start(self, images: int) -> None: ...
    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None: ...
    def record_waste(self, images: int) -> None: ...
    def record_stage(self, label: str, images: int, seconds: float) -> None:
        self.stages.append((label, images))


def test_sdxls_base_hands_its_refiner_latents_byte_identical_across_retries_and_resumed_from(
    tmp_path: Path, one_thread: None
) -> None:
    from worker.node.stop import StopSignal
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer
    from worker.render.runner import ShardRunner
    from worker.render.stages import StageRenderer

    cache = tmp_path / "models"
    base = load_pipeline("tiny-sdxl", device="cpu", cache_dir=cache)
    stages = (parse_refine("tiny-sdxl-refiner:0.5:4"),)
    params = RenderParams(model="tiny-sdxl", steps=2, width=32, height=32, stages=stages, keep_intermediates=1)
    msg = ShardMessage(job="j", shard=0, params=params, batch_size=2, queue="q", prompts=tuple(prompts(2, size=32)))
    refiners: list[StageRenderer] = []

    def factory(stage: Stage, index: int) -> StageRenderer:
        refiners.append(StageRenderer(stage, index, base=base, device="cpu", cache_dir=cache))
        return refiners[-1]

    class Counted(Renderer):
        generated = 0

        def render_images(self, batch: Sequence[Prompt], **kwargs: Any) -> list[Any]:
            Counted.generated += len(batch)
            return super().render_images(batch, **kwargs)

    store = LocalStore(tmp_path / "store")
    runner = ShardRunner(
        store=store, renderer=Counted(base), stop=StopSignal(), upload_threads=2, stages=ShardStages(store, factory)
    )

    def stored() -> dict[str, bytes]:
        return {key: store.get(key) or b"" for key in store.list("jobs/j/") if "/images/" in key or "/stages/" in key}

    def forget(*parts: str) -> None:
        for part in parts:
            store.delete_prefix(f"jobs/j/{part}/")

    try:
        runner.run(msg, Ledger(), first_delivery=True)
        first = stored()
        levels = sorted(key for key in first if "/stages/" in key)
        assert [key.rsplit("/", 2)[-2:] for key in levels] == [["0", "000000.safetensors"], ["0", "000001.safetensors"]]
        assert not any(key.endswith(".png") and "/stages/" in key for key in first)
        assert Counted.generated == 2 and len(refiners) == 1

        # A retry from nothing: the same latents and finals, byte for byte.
        forget("images", "checkpoints", "stages")
        runner.run(msg, Ledger(), first_delivery=True)
        assert stored() == first and Counted.generated == 4

        # A delivery after one lost in the refine: the latents taken back, nothing generated, the same finals.
        forget("images", "checkpoints")
        runner.run(msg, Ledger())
        assert stored() == first and Counted.generated == 4
    finally:
        runner.close()


def test_a_plain_workers_record_written_over_an_older_quantized_one_at_its_key_is_searched_anew(tmp_path: Path) -> None:
    """Before each recipe had keys of its own, an int8 worker wrote its record at the plain key; a plain
    worker now searches its own size there instead of refusing to render (a job's pin keeps recipes apart)."""
    store = LocalStore(tmp_path / "store")
    old = {"size": 2, "limit": 8, "oom": True, "how": "probe", "card": "Fake H200", "model": "m", "width": 16, "height": 16}
    store.put(BatchSizes.store_key(("Fake H200", "m", 16, 16)), json.dumps({**old, "quantize": "int8"}).encode())
    gpu = Generate(fits=99)
    assert BatchSizes(store, card=card).size_for(gpu, prompts(1)[0], 8) == 8 and gpu.calls  # probed, not refused
    assert record(store, ("Fake H200", "m", 16, 16))["quantize"] == "none"
