"""A GAN upscale stage (issue 39): ESRGAN's RRDBNet read from safetensors (worker/render/models/esrgan.py), its
shape taken from the weights, a pickle never loaded, the built-in tiny-esrgan through StageRenderer and
through a shard's stages, and the contract's forms and checks (renderfleet/stages.py)."""

from __future__ import annotations

import json
import resource
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from renderfleet import spec
from renderfleet.errors import InputError, ModelLoadError
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
from worker.render.models.esrgan import LIMITS, RRDBConfig, build_rrdbnet, load_esrgan, rrdb_config, tiny_esrgan_file
from worker.render.stagerun import ShardStages
from worker.render.stages import StageRenderer


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
    # Its finals are its inputs upscaled with a faint random texture, not near-black squares (issue 46).
    for image, final in zip(images, out, strict=True):
        near = np.asarray(image.convert("RGB").resize(final.size, Image.Resampling.NEAREST), dtype=np.int16)
        diff = np.abs(np.asarray(final, dtype=np.int16) - near)
        assert 0 < diff.mean() < 3 and diff.max() < 16, (diff.mean(), diff.max())


def test_a_gan_model_s_scale_must_be_the_stage_s_factor_and_the_allow_list_applies(tmp_path: Path) -> None:
    x2 = saved(tmp_path, RRDBConfig(3, 3, 8, 1, 4, 2), "x2.safetensors")
    assert renderer(f"2:{x2}", tmp_path).run(noise(1, 16), prompts(1, 16))[0].size == (32, 32)
    with pytest.raises(ModelLoadError, match=rf"--upscale 4:{x2}\): the model upscales x2, not x4; give --upscale 2:"):
        renderer(f"4:{x2}", tmp_path)
    with pytest.raises(ModelLoadError, match="allow-list"):
        renderer(f"4:{TINY_ESRGAN}", tmp_path, allowed=["tiny"])


def test_a_shard_through_generate_and_a_gan_upscale_stores_the_same_finals_on_a_retry(
    tmp_path: Path, one_thread: None
) -> None:
    from worker.node.stop import StopSignal
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer
    from worker.render.runner import ShardRunner

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


# ---- forged files: checked from the header, nothing built from a claim (issue 45, item 8) ------------


def forge(path: Path, header: dict[str, Any], data: bytes = b"") -> Path:
    """A safetensors file of ``header`` (each entry's dtype, shape, data_offsets, as written) and ``data``."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def zero_sized(features: int, blocks: int = 23, grow: int = 32) -> dict[str, Any]:
    """The security review's file: every tensor of an RRDBNet of ``features`` features, none holding a
    byte (a zero in each shape), so a file of a few hundred bytes per block claims any size."""
    shapes = {"conv_first.weight": [features, 3, 0, 3], "conv_last.weight": [3, features, 0, 3]}
    for b in range(blocks):
        for r in (1, 2, 3):
            for c in range(1, 6):
                cin = features + (c - 1) * grow
                shapes[f"body.{b}.rdb{r}.conv{c}.weight"] = [features if c == 5 else grow, cin, 0, 3]
    for k in ("conv_body", "conv_up1", "conv_up2", "conv_hr"):
        shapes[f"{k}.weight"] = [features, features, 0, 3]
    return {k: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for k, s in shapes.items()}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


@pytest.mark.parametrize("features", [2048, 16384])
def test_zero_size_tensors_claiming_a_huge_rrdbnet_are_refused_from_the_header_naming_the_shape(
    tmp_path: Path, features: int
) -> None:
    path = forge(tmp_path / "huge.safetensors", zero_sized(features))
    before = peak_rss_bytes()
    with pytest.raises(ModelLoadError) as caught:
        load_esrgan(path)
    # Before this, the worker built the claimed network (1.3 GB at 2048 features, 38 GB at 16384) and
    # died of it; the refusal names the file, the tensor, its shape and the architecture's range.
    message = str(caught.value)
    assert "huge.safetensors" in message
    assert f"conv_first.weight [{features}, 3, 0, 3] says num_feat {features}" in message
    assert f"1 to {LIMITS['num_feat']}" in message and "nothing built" in message
    # The peak never grew by the network's size (a lower bound: an earlier peak may hide growth, never fake it).
    assert peak_rss_bytes() - before < 256 << 20


def test_a_header_within_range_that_holds_no_weights_is_refused_by_its_parameter_count(tmp_path: Path) -> None:
    # 64 features, 23 blocks: Real-ESRGAN's own shape, claimed by a file of zero-size tensors.
    path = forge(tmp_path / "empty.safetensors", zero_sized(64))
    with pytest.raises(
        ModelLoadError, match=r"empty\.safetensors.*num_feat=64.* has \d+ parameters, the file's tensors hold 0"
    ):
        load_esrgan(path)


def test_a_header_whose_offsets_run_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path, RRDBConfig(3, 3, 8, 1, 4, 4), "cut.safetensors")
    path.write_bytes(path.read_bytes()[:-100])  # the last tensor's bytes are not all there
    with pytest.raises(
        ModelLoadError, match=r"cut\.safetensors': tensor '.*': its data_offsets \[\d+, \d+\] run past the end"
    ):
        load_esrgan(path)
    header = {"conv_first.weight": {"dtype": "F32", "shape": [8, 3, 3, 3], "data_offsets": [0, 864]}}
    with pytest.raises(ModelLoadError, match=r"data_offsets \[0, 864\] run past the end of the file \(16 bytes"):
        load_esrgan(forge(tmp_path / "short.safetensors", header, bytes(16)))
    (tmp_path / "long.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # a header longer than the file
    with pytest.raises(ModelLoadError, match=r"long\.safetensors': not a safetensors file \(a header of 1099511627776"):
        load_esrgan(tmp_path / "long.safetensors")
    deep = forge(tmp_path / "deep.safetensors", {})
    text = b"[" * 100_000 + b"]" * 100_000  # JSON nested past Python's recursion limit
    deep.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ModelLoadError, match=r"deep\.safetensors': not a safetensors file \(its header is no JSON"):
        load_esrgan(deep)


def test_a_tensor_whose_shape_and_offsets_disagree_is_refused_naming_both(tmp_path: Path) -> None:
    header = {"conv_first.weight": {"dtype": "F32", "shape": [2048, 3, 3, 3], "data_offsets": [0, 4]}}
    path = forge(tmp_path / "liar.safetensors", header, bytes(4))
    with pytest.raises(
        ModelLoadError,
        match=r"liar\.safetensors': tensor 'conv_first\.weight' of shape \[2048, 3, 3, 3\] \(F32\) needs 221184 bytes, "
        r"its data_offsets \[0, 4\] span 4",
    ):
        load_esrgan(path)
    header = {"conv_first.weight": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}
    with pytest.raises(ModelLoadError, match=r"'conv_first\.weight' is I64, not a float"):
        load_esrgan(forge(tmp_path / "ints.safetensors", header, bytes(8)))


def test_a_network_of_real_bytes_but_the_wrong_tensors_is_refused_before_its_weights_are_read(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in build_rrdbnet(RRDBConfig(3, 3, 8, 2, 4, 4)).state_dict().items()}
    state["body.7.rdb1.conv1.weight"] = state.pop("body.1.rdb1.conv1.weight")  # a block's tensor renamed
    save_file(state, tmp_path / "renamed.safetensors")
    with pytest.raises(ModelLoadError, match=r"renamed\.safetensors': an RRDBNet of .*num_block=3.* has \d+ parameters"):
        load_esrgan(tmp_path / "renamed.safetensors")
    state = {k: v.contiguous() for k, v in build_rrdbnet(RRDBConfig(3, 3, 8, 1, 4, 4)).state_dict().items()}
    state["conv_hr.weight"] = state["conv_hr.weight"].reshape(4, 16, 3, 3).contiguous()  # as many values, another shape
    save_file(state, tmp_path / "reshaped.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"tensor conv_hr\.weight has shape \[4, 16, 3, 3\]; an RRDBNet of .* has \[8, 8, 3, 3\]"
    ):
        load_esrgan(tmp_path / "reshaped.safetensors")


def test_a_valid_tiny_upscaler_still_loads_half_precision_weights_as_float32(tmp_path: Path) -> None:
    config = RRDBConfig(3, 3, 8, 2, 4, 4)
    torch.manual_seed(2)
    net = build_rrdbnet(config)
    save_file({k: v.half().contiguous() for k, v in net.state_dict().items()}, tmp_path / "half.safetensors")
    loaded, read = load_esrgan(tmp_path / "half.safetensors")
    assert read == config
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert not any(p.requires_grad for p in loaded.parameters())
    with torch.inference_mode():
        assert loaded(torch.rand(1, 3, 4, 4)).shape == (1, 3, 16, 16)


def test_a_stage_whose_upscaler_will_not_load_raises_the_job_s_error_never_a_bare_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from renderfleet.errors import DeviceError

    huge = forge(tmp_path / "huge.safetensors", zero_sized(2048))
    with pytest.raises(ModelLoadError, match=r"huge\.safetensors.*num_feat 2048"):
        renderer(f"4:{huge}", tmp_path)
    # Out of memory while loading (or any error a library raises): the job's, naming the stage and the file.
    good = saved(tmp_path, RRDBConfig(3, 3, 8, 1, 4, 4))

    def out_of_memory(path: Any, device: str = "cpu") -> Any:
        raise MemoryError("cannot allocate 1342177280 bytes")

    monkeypatch.setattr("worker.render.models.esrgan.load_esrgan", out_of_memory)
    with pytest.raises(ModelLoadError, match=rf"stage 1 \(upscale\): model '{good}' could not be loaded: MemoryError"):
        renderer(f"4:{good}", tmp_path)

    def device_lost(path: Any, device: str = "cpu") -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr("worker.render.models.esrgan.load_esrgan", device_lost)
    with pytest.raises(DeviceError, match="illegal memory access"):  # the node's, as any load's
        renderer(f"4:{good}", tmp_path)


def test_a_stage_model_that_will_not_load_fails_the_shard_as_the_job_s_not_its_prompts(tmp_path: Path) -> None:
    params = RenderParams(model="tiny", steps=2, width=8, height=8, stages=(parse_upscale("4:/m/x.safetensors"),))
    msg = ShardMessage(job="j", shard=0, params=params, batch_size=2, queue="q", prompts=tuple(prompts(2, 8)))
    built: list[int] = []

    def factory(stage: Stage, index: int) -> Any:
        built.append(index)
        raise ModelLoadError("model '/m/x.safetensors': conv_first.weight [2048, 3, 0, 3] says num_feat 2048")

    stages = ShardStages(LocalStore(tmp_path / "store"), factory)
    images = {p.name: noise(1, 8)[0] for p in msg.prompts}
    failures: list[Any] = []
    base = object()  # the job's model: the stages built for it are kept while it stays
    with pytest.raises(ModelLoadError, match="num_feat 2048"):
        stages.run(msg, base, list(msg.prompts), images, {}, failures, lambda: False)
    # Not each prompt's failure (quarantined three times over): the worker's service fails the job once.
    assert failures == []
    with pytest.raises(ModelLoadError):  # kept, not loaded again for the next batch
        stages.run(msg, base, list(msg.prompts), images, {}, failures, lambda: False)
    assert built == [0]
