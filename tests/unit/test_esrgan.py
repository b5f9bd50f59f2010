"""A GAN upscale stage (issue 39): ESRGAN's RRDBNet read from safetensors (worker/models/esrgan.py), its
shape taken from the weights, a pickle never loaded, the built-in tiny-esrgan through StageRenderer and
through a shard's stages, and the contract's forms and checks (renderfleet/stages.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from renderfleet import spec
from renderfleet.errors import InputError, JobError, ModelLoadError
from renderfleet.spec import Prompt, RenderParams, ShardMessage
from renderfleet.stages import (
    TINY_ESRGAN,
    UPSCALE,
    Stage,
    cli_form,
    describe,
    is_gan_upscaler,
    parse_refine,
    parse_upscale,
    stage_problem,
)
from renderfleet.store import LocalStore
from tests.unit.test_stage_batches import Ledger
from worker.models.esrgan import RRDBConfig, build_rrdbnet, load_esrgan, rrdb_config, tiny_esrgan_file
from worker.stagerun import ShardStages
from worker.stages import StageRenderer


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Pixels compared byte for byte: one thread, so no reduction order differs between calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def saved(tmp_path: Path, config: RRDBConfig, name: str = "net.safetensors") -> Path:
    torch.manual_seed(1)
    net = build_rrdbnet(config)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / name)
    return tmp_path / name


def noise(n: int, size: int) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(size)
    return [
        Image.fromarray((torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()) for _ in range(n)
    ]


def prompts(n: int, size: int) -> list[Prompt]:
    return [Prompt(i, spec.index_name(i), f"p{i}", "", spec.derive_seed(0, i), 2, 7.5, size, size) for i in range(n)]


def renderer(text: str, cache_dir: Path, **kwargs: Any) -> StageRenderer:
    return StageRenderer(parse_upscale(text), 0, base=None, device="cpu", cache_dir=cache_dir, **kwargs)


# ---- the network -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        RRDBConfig(num_in_ch=3, num_out_ch=3, num_feat=8, num_block=3, num_grow_ch=4, scale=4),
        RRDBConfig(num_in_ch=3, num_out_ch=3, num_feat=12, num_block=1, num_grow_ch=6, scale=2),  # pixel-unshuffled
    ],
)
def test_the_architecture_is_read_from_a_saved_state_dict_and_upscales_by_its_scale(
    tmp_path: Path, config: RRDBConfig
) -> None:
    from safetensors.torch import load_file

    path = saved(tmp_path, config)
    assert rrdb_config(load_file(path)) == config
    net, read = load_esrgan(path)
    assert read == config
    with torch.inference_mode():
        out = net(torch.rand(1, 3, 8, 8))
    assert out.shape == (1, 3, 8 * config.scale, 8 * config.scale)


def test_a_pickle_is_never_loaded_and_other_weights_are_refused_naming_the_file(tmp_path: Path) -> None:
    state = build_rrdbnet(RRDBConfig(3, 3, 8, 1, 4, 4)).state_dict()
    torch.save(state, tmp_path / "net.pth")
    with pytest.raises(ModelLoadError, match=r"net\.pth.*never a pickle"):
        load_esrgan(tmp_path / "net.pth")
    (tmp_path / "renamed.safetensors").write_bytes((tmp_path / "net.pth").read_bytes())  # a pickle by another name
    with pytest.raises(ModelLoadError, match=r"renamed\.safetensors.*not a safetensors file"):
        load_esrgan(tmp_path / "renamed.safetensors")
    save_file({"weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(ModelLoadError, match=r"other\.safetensors.*not an ESRGAN RRDBNet"):
        load_esrgan(tmp_path / "other.safetensors")
    with pytest.raises(ModelLoadError, match=r"gone\.safetensors.*no such file"):
        load_esrgan(tmp_path / "gone.safetensors")


# ---- the stage ---------------------------------------------------------------------------------------


def test_tiny_esrgan_upscales_four_times_the_same_bytes_twice(tmp_path: Path, one_thread: None) -> None:
    stage = renderer(f"4:{TINY_ESRGAN}", tmp_path)
    assert stage.loaded_models() == [TINY_ESRGAN] and stage.batch_key == (TINY_ESRGAN, "upscale-x4")
    images = noise(2, 24)
    out = stage.run(images, prompts(2, 24))
    assert [image.size for image in out] == [(96, 96)] * 2 and out[0].mode == "RGB"
    assert [i.tobytes() for i in out] == [i.tobytes() for i in stage.run(images, prompts(2, 24))]
    # Its weights are a safetensors file, read back by the path any file takes: the same bytes.
    again = renderer(f"4:{tiny_esrgan_file(tmp_path)}", tmp_path).run(images, prompts(2, 24))
    assert [i.tobytes() for i in out] == [i.tobytes() for i in again]


def test_a_gan_model_s_scale_must_be_the_stage_s_factor_and_the_allow_list_applies(tmp_path: Path) -> None:
    x2 = saved(tmp_path, RRDBConfig(3, 3, 8, 1, 4, 2), "x2.safetensors")
    assert renderer(f"2:{x2}", tmp_path).run(noise(1, 16), prompts(1, 16))[0].size == (32, 32)
    with pytest.raises(JobError, match=rf"--upscale 4:{x2}\): the model upscales x2, not x4; give --upscale 2:"):
        renderer(f"4:{x2}", tmp_path)
    with pytest.raises(ModelLoadError, match="allow-list"):
        renderer(f"4:{TINY_ESRGAN}", tmp_path, allowed=["tiny"])


def test_a_shard_through_generate_and_a_gan_upscale_stores_the_same_finals_on_a_retry(
    tmp_path: Path, one_thread: None
) -> None:
    from worker.models import load_pipeline
    from worker.render import Renderer
    from worker.runner import ShardRunner
    from worker.stop import StopSignal

    cache = tmp_path / "models"
    base = load_pipeline("tiny", device="cpu", cache_dir=cache)
    params = RenderParams(model="tiny", steps=2, width=32, height=32, stages=(parse_upscale(f"4:{TINY_ESRGAN}"),))
    msg = ShardMessage(job="j", shard=0, params=params, batch_size=2, queue="q", prompts=tuple(prompts(2, 32)))

    def factory(stage: Stage, index: int) -> StageRenderer:
        return StageRenderer(stage, index, base=base, device="cpu", cache_dir=cache)

    store = LocalStore(tmp_path / "store")
    runner = ShardRunner(
        store=store, renderer=Renderer(base), stop=StopSignal(), upload_threads=2, stages=ShardStages(store, factory)
    )

    def finals() -> dict[str, bytes]:
        return {key: store.get(key) or b"" for key in store.list("jobs/j/images/")}

    try:
        runner.run(msg, Ledger(), first_delivery=True)
        first = finals()
        assert len(first) == 2
        import io

        assert {Image.open(io.BytesIO(data)).size for data in first.values()} == {(128, 128)}
        store.delete_prefix("jobs/j/")
        runner.run(msg, Ledger(), first_delivery=True)
        assert finals() == first
    finally:
        runner.close()


# ---- the contract ------------------------------------------------------------------------------------


def test_gan_upscalers_parse_without_steps_and_say_so() -> None:
    assert is_gan_upscaler(TINY_ESRGAN) and is_gan_upscaler("/m/RealESRGAN_x4plus.safetensors")
    assert not is_gan_upscaler("tiny-x4-upscaler") and not is_gan_upscaler("")
    stage = parse_upscale("4:/m/RealESRGAN_x4plus.safetensors")
    assert stage == Stage(UPSCALE, model="/m/RealESRGAN_x4plus.safetensors", factor=4)
    assert parse_upscale("2:/m/RealESRGAN_x2plus.safetensors").factor == 2  # the worker checks the model's scale
    assert describe(parse_upscale(f"4:{TINY_ESRGAN}")) == f"upscale x4 with {TINY_ESRGAN} (GAN)"
    assert cli_form(parse_upscale(f"4:{TINY_ESRGAN}@big")) == f"--upscale 4:{TINY_ESRGAN}@big"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f"2:{TINY_ESRGAN}", "tiny-esrgan upscales x4 only"),
        (f"4:{TINY_ESRGAN}:10", "a GAN upscaler runs once"),
        ("4:/m/x4.safetensors:10", "a GAN upscaler runs once"),
        ("4:/m/RealESRGAN_x4plus.pth", r"is a pickle.*never loaded"),
        ("4:s3://bucket/esrgan.ckpt", r"is a pickle.*never loaded"),
    ],
)
def test_a_bad_gan_upscale_is_refused_naming_the_flag(text: str, why: str) -> None:
    with pytest.raises(InputError, match=rf"--upscale '{text}': .*{why}"):
        parse_upscale(text)


def test_a_gan_upscaler_refines_nothing_and_takes_no_steps_by_any_road() -> None:
    with pytest.raises(InputError, match="an upscaler; use it in --upscale"):
        parse_refine(TINY_ESRGAN)
    assert "runs once and has none" in (stage_problem(Stage(UPSCALE, model=TINY_ESRGAN, factor=4, steps=5)) or "")
