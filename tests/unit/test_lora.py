"""LoRA adapters, hub revisions and variants, and a folder model's digest: the weights a job pins.

Names and checks need no model; the rest renders with the tiny model and a tiny LoRA made here
(testing/loras.py), with one torch thread, since bytes are compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dispatcher.jobs.submit import SubmitOptions, check_options, job_id
from renderfleet.errors import InputError, JobError, ModelLoadError
from renderfleet.spec import (
    Prompt,
    RenderParams,
    ShardMessage,
    lora_source_problem,
    loras_problem,
    message_problems,
    parse_lora,
)
from testing.messages import message_dict

# ---- names and checks: no model ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("owner/style-lora", ("owner/style-lora", 1.0)),
        ("owner/style-lora:0.8", ("owner/style-lora", 0.8)),
        ("s3://bucket/loras/a.safetensors", ("s3://bucket/loras/a.safetensors", 1.0)),
        ("s3://bucket/loras/a.safetensors:0.8", ("s3://bucket/loras/a.safetensors", 0.8)),
        ("s3://bucket/loras/a.safetensors:-1.5", ("s3://bucket/loras/a.safetensors", -1.5)),
        ("/models/a:b/x.safetensors", ("/models/a:b/x.safetensors", 1.0)),  # a colon inside the path stays
        ("./style.safetensors:2", ("./style.safetensors", 2.0)),
        (":0.5", (":0.5", 1.0)),  # no source before the colon: the whole text is the source
    ],
)
def test_a_lora_scale_is_read_from_the_last_colon_only_when_it_is_a_number(text: str, parsed: tuple[str, float]) -> None:
    assert parse_lora(text) == parsed


@pytest.mark.parametrize(
    "source", ["owner/lora/model.bin", "./style.pt", "/x/style.ckpt", "s3://b/l/a.pth", "owner/repo/weights.PKL"]
)
def test_pickled_lora_weights_are_refused_with_the_reason(source: str) -> None:
    assert "pickled weights" in (lora_source_problem(source) or "")
    assert "safetensors" in (lora_source_problem(source) or "")


def test_lora_lists_are_checked_for_shape_scale_count_and_duplicates() -> None:
    assert loras_problem([("owner/a", 1.0), ("./b.safetensors", -0.5)]) is None
    assert "s3:// LoRA is one .safetensors file" in (loras_problem([("s3://b/loras/", 1.0)]) or "")
    assert "scale" in (loras_problem([("owner/a", float("nan"))]) or "")
    assert "scale" in (loras_problem([("owner/a", 11)]) or "")
    assert "given twice" in (loras_problem([("owner/a", 1.0), ("owner/a", 0.5)]) or "")
    assert "at most 8" in (loras_problem([(f"owner/a{i}", 1.0) for i in range(9)]) or "")
    assert "pairs" in (loras_problem(["owner/a"]) or "")


def test_submit_refuses_bad_loras_revisions_and_variants_naming_the_flag(tmp_path: Path) -> None:
    def problems(**params: object) -> list[str]:
        with pytest.raises(InputError) as exc:
            check_options(SubmitOptions(params=RenderParams(**params)))  # type: ignore[arg-type]
        return exc.value.problems

    assert problems(model="owner/m", loras=(("owner/l/x.bin", 1.0),))[0].startswith("--lora: lora 'owner/l/x.bin'")
    assert problems(model="tiny", revision="main")[0].startswith("--revision: pins a hub id's weights")
    assert problems(model=str(tmp_path), revision="v1")[0].startswith("--revision")
    assert problems(model="tiny", variant="fp16")[0].startswith("--variant")
    assert problems(model="owner/m", revision="../x")[0].startswith("--revision: revision must be")
    assert problems(model="owner/m", variant="fp 16")[0].startswith("--variant: variant must be")
    check_options(
        SubmitOptions(params=RenderParams(model="owner/m", revision="v1.0", variant="fp16", loras=(("owner/l", 0.7),)))
    )
    check_options(SubmitOptions(params=RenderParams(model=str(tmp_path), variant="fp16")))


def test_a_job_without_the_new_settings_keeps_its_id_and_its_message() -> None:
    plain = RenderParams(model="tiny", steps=2)
    # the identity of a job from before LoRAs, revisions and digests: no new key at all
    assert set(plain.identity()) == {"model", "steps", "width", "height", "guidance", "negative_prompt", "seed"}
    assert (
        job_id("d", plain, "/store")
        == "j-"
        + __import__("hashlib")
        .sha256(json.dumps({"content": "d", "params": plain.identity(), "store": "/store"}, sort_keys=True).encode())
        .hexdigest()[:16]
    )
    with_lora = dataclasses.replace(plain, loras=(("owner/l", 0.8),))
    pinned = dataclasses.replace(plain, model="owner/m", revision="abc123", variant="fp16")
    assert with_lora.identity()["loras"] == (("owner/l", 0.8),)
    assert (
        len(
            {
                job_id("d", p, "/store")
                for p in (plain, with_lora, pinned, dataclasses.replace(with_lora, loras=(("owner/l", 0.9),)))
            }
        )
        == 4
    )
    # the settings round-trip through JSON (the spec, the message) as equal values
    assert RenderParams.from_dict(json.loads(json.dumps(with_lora.identity()))) == with_lora


def raw_message(params: dict[str, object]) -> dict[str, object]:
    """A decoded shard message whose params are ``params`` as written into Redis."""
    msg = ShardMessage("j-0123456789abcdef", 0, RenderParams(), 1, "renderfleet.default.0123456789ab", count=1)
    return {**message_dict(msg), "params": params}


def test_the_worker_checks_a_messages_loras_and_pins_as_submit_does() -> None:
    good = raw_message(
        {
            "model": "owner/m",
            "loras": [["owner/l", 0.5]],
            "revision": "v1",
            "variant": "fp16",
            "model_digest": "files-sha256:" + "0" * 64,
        }
    )
    assert message_problems(good) == []
    assert ShardMessage.from_dict(good).params.loras == (("owner/l", 0.5),)
    for params, why in (
        ({"loras": [["x.pt", 1.0]]}, "pickled"),
        ({"loras": "owner/l"}, "loras must be a list"),
        ({"loras": [["owner/l", "1"]]}, "scale"),
        ({"revision": "a b"}, "revision must be"),
        ({"model_digest": "md5:00"}, "model_digest must be"),
    ):
        problems = message_problems(raw_message({"model": "owner/m", **params}))
        assert len(problems) == 1 and why in problems[0], problems


# ---- each LoRA pinned by content at submit, its pin honoured on the worker: no model ----------------


def pinned_options(tmp_path: Path, loras: list[str], hub: Any = None) -> RenderParams:
    from renderfleet.api import Client
    from renderfleet.settings import Settings

    client = Client(
        Settings(home=tmp_path / "home", store=str(tmp_path / "store")),
        resolve_revision=None if hub is None else lambda repo, revision: hub(repo),
    )
    return client.options(model="tiny", loras=loras).params


def test_submit_pins_each_lora_by_its_content_and_a_hub_lora_by_the_resolvers_commit(tmp_path: Path) -> None:
    from renderfleet.digests import file_digest, folder_digest

    (tmp_path / "a.safetensors").write_bytes(b"weights a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "pytorch_lora_weights.safetensors").write_bytes(b"weights b")
    asked: list[str] = []

    def hub(repo: str) -> str:
        asked.append(repo)
        return "c" * 40

    params = pinned_options(
        tmp_path,
        [
            f"{tmp_path}/a.safetensors:0.5",
            str(tmp_path / "b"),
            "owner/style/sub/dir/x.safetensors:0.8",
            "/only/on/workers.safetensors",
        ],
        hub,
    )
    assert params.loras == (
        (f"{tmp_path}/a.safetensors", 0.5, file_digest(tmp_path / "a.safetensors")),
        (str(tmp_path / "b"), 1.0, folder_digest(tmp_path / "b")),
        ("owner/style/sub/dir/x.safetensors", 0.8, "hub-commit:" + "c" * 40),
        ("/only/on/workers.safetensors", 1.0),
    )  # a path submit cannot see: unpinned
    assert asked == ["owner/style"]  # the repo, not the path inside it
    assert params.loras[0][2] == "file-sha256:" + __import__("hashlib").sha256(b"weights a").hexdigest()
    # the pins travel: checked in a message as submit checks them, and equal after JSON
    assert message_problems(raw_message({"model": "tiny", "loras": [list(lora) for lora in params.loras]})) == []
    assert RenderParams.from_dict(json.loads(json.dumps(params.identity()))) == params
    # other bytes, another job
    (tmp_path / "a.safetensors").write_bytes(b"weights a, retrained")
    again = pinned_options(tmp_path, [f"{tmp_path}/a.safetensors:0.5"], hub)
    assert job_id("d", again, "/s") != job_id("d", dataclasses.replace(again, loras=params.loras[:1]), "/s")


def test_without_a_hub_to_ask_a_hub_lora_is_recorded_unpinned_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from renderfleet.hubrev import hub_commit

    assert pinned_options(tmp_path, ["owner/style:0.7"], lambda repo: None).loras == (("owner/style", 0.7),)
    # the default resolver asks no hub when told it is offline (as every test and many fleets are)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("asked the hub"))
    assert hub_commit("owner/style", "") is None
    assert pinned_options(tmp_path, ["owner/style"]).loras == (("owner/style", 1.0),)


def test_a_lora_pin_in_a_message_is_checked_as_submit_makes_it() -> None:
    for pin in (
        "file-sha256:" + "0" * 64,
        "files-sha256:" + "0" * 64,
        "s3-etag:9b2cf535f27731c974343645a3985328",
        "s3-etag:9b2cf535f27731c974343645a3985328-3",
        "s3-version:3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY",
        "hub-commit:" + "a" * 40,
    ):
        assert loras_problem([("owner/l", 1.0, pin)]) is None, pin
    for pin in ("md5:00", "hub-commit:main", "file-sha256:xyz", "", 3):
        problems = message_problems(raw_message({"model": "tiny", "loras": [["owner/l", 1.0, pin]]}))
        assert len(problems) == 1 and "its digest must be" in problems[0], (pin, problems)


def s3_client() -> Any:
    import boto3

    return boto3.session.Session().client("s3")


def test_an_s3_lora_replaced_after_submit_is_refused_and_its_cache_is_keyed_by_the_pin(
    s3_bucket: str, tmp_path: Path
) -> None:
    from dispatcher.jobs.submit import lora_pin
    from worker.render.loras import fetch_s3_lora

    bucket = s3_bucket[len("s3://") :].split("/")[0]
    client, uri = s3_client(), f"s3://{bucket}/loras/style.safetensors"
    client.put_object(Bucket=bucket, Key="loras/style.safetensors", Body=b"first")
    first = lora_pin(uri)
    assert first.startswith("s3-etag:")
    cache = tmp_path / "loras"
    held = fetch_s3_lora(uri, first, cache_dir=cache, max_bytes=1000)
    assert held.read_bytes() == b"first" and held.name == "style.safetensors"
    client.put_object(Bucket=bucket, Key="loras/style.safetensors", Body=b"second")
    second = lora_pin(uri)
    assert second != first
    # a worker that fetched it before the change keeps serving what the job pinned
    assert fetch_s3_lora(uri, first, cache_dir=cache, max_bytes=1000).read_bytes() == b"first"
    # a worker fetching now: the job's error, naming the change, never the new bytes
    with pytest.raises(JobError, match="changed since the job was submitted") as exc:
        fetch_s3_lora(uri, first, cache_dir=tmp_path / "other-node", max_bytes=1000)
    assert "\n" not in str(exc.value) and first in str(exc.value)
    assert not any((tmp_path / "other-node").glob("*/style.safetensors"))
    new = fetch_s3_lora(uri, second, cache_dir=cache, max_bytes=1000)
    assert new.read_bytes() == b"second" and new.parent != held.parent  # keyed by the pin, not the URL
    with pytest.raises(JobError, match="MODEL_MAX_BYTES"):
        fetch_s3_lora(uri, second, cache_dir=tmp_path / "small", max_bytes=3)
    with pytest.raises(InputError, match="no such object"):
        lora_pin(f"s3://{bucket}/loras/none.safetensors")


def test_an_s3_lora_in_a_versioned_bucket_is_fetched_at_the_version_submit_saw(s3_bucket: str, tmp_path: Path) -> None:
    from dispatcher.jobs.submit import lora_pin
    from worker.render.loras import fetch_s3_lora

    bucket = s3_bucket[len("s3://") :].split("/")[0]
    client, uri = s3_client(), f"s3://{bucket}/loras/v.safetensors"
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    client.put_object(Bucket=bucket, Key="loras/v.safetensors", Body=b"first")
    pin = lora_pin(uri)
    assert pin.startswith("s3-version:")
    client.put_object(Bucket=bucket, Key="loras/v.safetensors", Body=b"second")
    assert fetch_s3_lora(uri, pin, cache_dir=tmp_path, max_bytes=1000).read_bytes() == b"first"


# ---- rendering with the tiny model -----------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from testing.loras import make_tiny_lora  # noqa: E402
from worker.render.loras import LoraCache  # noqa: E402
from worker.render.models import LoadedModel, check_digest, load_pipeline, save_pipeline  # noqa: E402
from worker.render.pipeline import Renderer  # noqa: E402


def prompt(**changes: object) -> Prompt:
    return dataclasses.replace(Prompt(0, "000000", "a red fox", "", 5, 2, 7.5, 32, 32), **changes)  # type: ignore[arg-type]


def pixels(data: bytes) -> bytes:
    """An image file's pixels, without its metadata (which names the model)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.tobytes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)  # bytes compared below: the same thread count throughout
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("loras")
    return (
        str(make_tiny_lora(folder / "a.safetensors", seed=1)),
        str(make_tiny_lora(folder / "b" / "pytorch_lora_weights.safetensors", seed=2).parent),
    )


def test_loras_switch_per_call_on_one_pipeline_and_each_state_renders_the_same_bytes(
    tiny: LoadedModel, loras: tuple[str, str]
) -> None:
    a, b = loras
    renderer = Renderer(tiny, loras=LoraCache(tiny.pipe, max_warm=1))
    plain = renderer.render([prompt()])[0]
    with_a = renderer.render([prompt(loras=((a, 1.0),))])[0]
    with_b = renderer.render([prompt(loras=((b, 0.8),))])[0]  # a folder: its pytorch_lora_weights.safetensors
    both = renderer.render([prompt(loras=((a, 1.0), (b, 0.8)))])[0]
    assert len({plain, with_a, with_b, both}) == 4  # each adapter and scale changes the image
    assert renderer.loras.warm == [a, b]  # both needed by the last call: kept beyond the budget of 1
    # back to none, then a alone again: the same bytes as the first time (nothing leaks between jobs)
    assert renderer.render([prompt()])[0] == plain
    assert renderer.render([prompt(loras=((a, 1.0),))])[0] == with_a
    assert renderer.loras.warm == [a]  # b was the least recent beyond the budget: deleted
    assert renderer.render([prompt(loras=((a, 0.0),))])[0] != with_a  # scale 0: the adapter off
    assert renderer.loras.loads == 3 and tiny.pipe.get_list_adapters() == {"unet": [renderer.loras._warm[(a, "")]]}
    meta = __import__("renderfleet.images", fromlist=["read_metadata"]).read_metadata(with_a)
    assert json.loads(meta["loras"]) == [[a, 1.0]]
    tiny.pipe.delete_adapters(list(renderer.loras._warm.values()))  # the module's pipeline as it was


def test_a_lora_with_text_encoder_weights_loads_changes_the_image_and_leaves_no_trace(
    tiny: LoadedModel, loras: tuple[str, str], tmp_path: Path
) -> None:
    # Most SD LoRAs carry text-encoder weights, which diffusers hands to transformers' load_adapter:
    # it refuses a peft below transformers' MIN_PEFT_VERSION (the pins in pyproject.toml). Its keys
    # named as in the hub's LoRAs (text_model.…, from before transformers 5); the fleet test's use today's.
    unet_only, other = loras  # unet_only: seed 1, the same UNet weights as the LoRA below
    both = str(make_tiny_lora(tmp_path / "te.safetensors", seed=1, text_encoder=True, text_model_names=True))
    renderer = Renderer(tiny, loras=LoraCache(tiny.pipe, max_warm=2))
    plain = renderer.render([prompt()])[0]
    with_unet_only = renderer.render([prompt(loras=((unet_only, 1.0),))])[0]
    with_both = renderer.render([prompt(loras=((both, 1.0),))])[0]
    assert set(tiny.pipe.get_list_adapters()) == {"unet", "text_encoder"}
    assert len({plain, with_unet_only, with_both}) == 3  # the text encoder's weights change the image
    # the next jobs, the text encoder's adapter still loaded: the same bytes as before it
    assert renderer.render([prompt()])[0] == plain
    assert renderer.render([prompt(loras=((unet_only, 1.0),))])[0] == with_unet_only
    assert renderer.render([prompt(loras=((both, 1.0),))])[0] == with_both
    # deleted (the least recently used past the budget of 2): the same bytes again
    renderer.render([prompt(loras=((unet_only, 1.0),))])
    renderer.render([prompt(loras=((other, 1.0),))])
    assert renderer.loras.warm == [unet_only, other] and set(tiny.pipe.get_list_adapters()) == {"unet"}
    assert renderer.render([prompt(loras=((unet_only, 1.0),))])[0] == with_unet_only
    assert renderer.render([prompt()])[0] == plain
    tiny.pipe.delete_adapters(list(renderer.loras._warm.values()))


def test_the_pinned_weights_are_written_into_the_image_only_when_set() -> None:
    from worker.render.pipeline import image_metadata

    digest = "files-sha256:" + "a" * 64
    pinned = image_metadata(
        prompt(revision="v1.0", variant="fp16", model_digest=digest, loras=(("owner/l", 0.5),)), "owner/m"
    )
    assert (pinned["revision"], pinned["variant"], pinned["model_digest"]) == ("v1.0", "fp16", digest)
    assert json.loads(pinned["loras"]) == [["owner/l", 0.5]]
    assert not {"revision", "variant", "model_digest", "loras"} & set(image_metadata(prompt(), "owner/m"))


def test_a_lora_off_the_allow_list_or_missing_is_the_jobs_error(
    tiny: LoadedModel, loras: tuple[str, str], tmp_path: Path
) -> None:
    cache = LoraCache(tiny.pipe, allowed=["tiny"])
    with pytest.raises(JobError, match="allow-list"):
        cache.use([(loras[0], 1.0)])
    allowed = LoraCache(tiny.pipe, allowed=[str(Path(loras[0]).parent)])
    allowed.use([(loras[0], 1.0)])  # under an allowed folder
    allowed.use(())
    tiny.pipe.delete_adapters(list(allowed._warm.values()))
    with pytest.raises(JobError, match="could not be loaded"):
        LoraCache(tiny.pipe).use([(str(tmp_path / "none.safetensors"), 1.0)])
    assert tiny.pipe.get_list_adapters() == {}
    # a job's LoRA that fails to load after another job's was set: the next job without LoRAs gets none
    renderer = Renderer(tiny)
    plain = renderer.render([prompt()])[0]
    assert renderer.render([prompt(loras=((loras[0], 1.0),))])[0] != plain
    with pytest.raises(JobError, match="could not be loaded"):
        renderer.render([prompt(loras=((loras[0], 1.0), (str(tmp_path / "none.safetensors"), 1.0)))])
    assert renderer.render([prompt()])[0] == plain
    tiny.pipe.delete_adapters(list(renderer.loras._warm.values()))


def test_a_lora_with_no_weights_for_this_model_is_the_jobs_error_and_is_not_kept(tiny: LoadedModel, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    # Keys of another architecture (a transformer's): diffusers only warns that none fits, and
    # set_adapters then raised a bare ValueError, which the worker took for its own bug.
    other = tmp_path / "other-architecture.safetensors"
    save_file(
        {
            "transformer.blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
            "transformer.blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4),
        },
        str(other),
    )
    renderer = Renderer(tiny)
    plain = renderer.render([prompt()])[0]
    for _ in range(2):  # not kept warm as if loaded: the second job is refused the same way
        with pytest.raises(JobError, match="could not be loaded: none of its weights fit"):
            renderer.render([prompt(loras=((str(other), 1.0),))])
    assert renderer.loras.warm == [] and tiny.pipe.get_list_adapters() == {}
    assert renderer.render([prompt()])[0] == plain


def test_a_lora_file_that_is_no_safetensors_is_the_jobs_error(tiny: LoadedModel, tmp_path: Path) -> None:
    # A git-lfs pointer committed in place of the weights (or a truncated upload): safetensors raises
    # its own SafetensorError, no OSError or ValueError; a bare exception loops the shard round the fleet.
    pointer = tmp_path / "style.safetensors"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 9\n")
    cache = LoraCache(tiny.pipe)
    with pytest.raises(JobError, match="could not be loaded"):
        cache.use([(str(pointer), 1.0)])
    assert cache.warm == [] and tiny.pipe.get_list_adapters() == {}


def test_a_jobs_loras_are_set_before_its_long_prompts_are_embedded(tiny: LoadedModel, loras: tuple[str, str]) -> None:
    # A long prompt's embeddings are made by the text encoder before the pipeline call, and a LoRA
    # may change the text encoder (most of SD's do): made before the job's adapters are set, they
    # would carry the last job's (or none), and a redelivery elsewhere would render other bytes.
    renderer = Renderer(tiny)
    order: list[str] = []
    embed, use = renderer.long_prompts.embed, renderer.loras.use

    def embedding(prompts: Any) -> Any:
        order.append("embed")
        return embed(prompts)

    def using(wanted: Any) -> None:
        order.append("use")
        use(wanted)

    renderer.long_prompts.embed = embedding  # type: ignore[method-assign]
    renderer.loras.use = using  # type: ignore[method-assign,assignment]
    renderer.render(
        [prompt(prompt="a lighthouse at dusk, oil painting, waves breaking on black rocks. " * 3, loras=((loras[0], 1.0),))]
    )
    assert order[:2] == ["use", "embed"]
    tiny.pipe.delete_adapters(list(renderer.loras._warm.values()))


def test_a_device_failure_while_loading_a_lora_is_the_nodes_not_the_jobs(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from renderfleet.errors import DeviceError

    def load_lora_weights(*_: object, **__: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    pipe = SimpleNamespace(load_lora_weights=load_lora_weights, get_list_adapters=dict)
    with pytest.raises(DeviceError, match="illegal memory access"):
        LoraCache(pipe).use([(str(lora), 1.0)])


@pytest.fixture(scope="module")
def untouched(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny pipeline no adapter was ever loaded into (PEFT leaves its wrappers behind: saved, they
    would be other weights' names)."""
    torch.set_num_threads(1)
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


def test_a_saved_variant_loads_back_by_its_variant(untouched: LoadedModel, tmp_path: Path) -> None:
    tiny = untouched
    folder = tmp_path / "tiny-fp16"
    tiny.pipe.save_pretrained(folder, variant="fp16", safe_serialization=True)
    assert list(folder.glob("unet/*.fp16.safetensors"))
    loaded = load_pipeline(str(folder), device="cpu", cache_dir=tmp_path / "cache", variant="fp16")
    assert loaded.variant == "fp16"
    # the same weights under the variant's names (saved as they were, float32): the same pixels
    assert pixels(Renderer(loaded).render([prompt()])[0]) == pixels(Renderer(tiny).render([prompt()])[0])
    with pytest.raises(ModelLoadError, match="variant 'bf16'"):
        load_pipeline(str(folder), device="cpu", cache_dir=tmp_path / "cache", variant="bf16")
    with pytest.raises(ModelLoadError, match="a revision pins a hub id"):
        load_pipeline(str(folder), device="cpu", cache_dir=tmp_path / "cache", revision="main")


def test_a_hub_id_is_asked_for_at_its_revision_and_variant_in_safetensors(
    untouched: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import diffusers

    asked: list[tuple[str, dict[str, object]]] = []

    def from_pretrained(name: str, **kwargs: object) -> object:  # the hub, which this machine cannot reach
        asked.append((name, kwargs))
        return untouched.pipe

    monkeypatch.setattr(diffusers.AutoPipelineForText2Image, "from_pretrained", from_pretrained)
    loaded = load_pipeline("owner/model", device="cpu", cache_dir=tmp_path, revision="0123abc", variant="fp16")
    [(name, kwargs)] = asked
    assert name == "owner/model" and (kwargs["revision"], kwargs["variant"], kwargs["use_safetensors"]) == (
        "0123abc",
        "fp16",
        True,
    )
    assert (loaded.revision, loaded.variant, loaded.digest) == ("0123abc", "fp16", "")
    load_pipeline("owner/model", device="cpu", cache_dir=tmp_path)
    assert (asked[1][1]["revision"], asked[1][1]["variant"]) == (None, None)  # unpinned: the hub's defaults


def test_a_folder_models_digest_is_recorded_and_a_changed_folder_is_refused(untouched: LoadedModel, tmp_path: Path) -> None:
    from renderfleet.api import Client
    from renderfleet.settings import Settings

    folder = save_pipeline(untouched, tmp_path / "model")
    opts = Client(Settings(home=tmp_path / "home", store=str(tmp_path / "store"))).options(model=str(folder))
    assert opts.params.model_digest.startswith("files-sha256:")
    loaded = load_pipeline(str(folder), device="cpu", cache_dir=tmp_path / "cache")
    assert loaded.digest == opts.params.model_digest
    check_digest(loaded, opts.params.model_digest)  # the same files: rendered
    check_digest(loaded, "")  # a job that recorded none (a hub id, an older submit)
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace("}", ', "x": 1}', 1))
    changed = Client(Settings(home=tmp_path / "home", store=str(tmp_path / "store"))).options(model=str(folder))
    assert changed.params.model_digest != opts.params.model_digest
    with pytest.raises(ModelLoadError, match="changed since the job was submitted"):
        check_digest(loaded, changed.params.model_digest)


def test_a_local_lora_changed_after_submit_is_the_jobs_error_and_the_pinned_adapter_stays_usable(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    from renderfleet.digests import file_digest, folder_digest

    path = make_tiny_lora(tmp_path / "style.safetensors", seed=1)
    folder = make_tiny_lora(tmp_path / "folder" / "pytorch_lora_weights.safetensors", seed=2).parent
    pinned, pinned_folder = file_digest(path), folder_digest(folder)
    renderer = Renderer(tiny, loras=LoraCache(tiny.pipe))
    with_pin = renderer.render([prompt(loras=((str(path), 1.0, pinned),))])[0]
    unpinned = renderer.render([prompt(loras=((str(path), 1.0),))])[0]
    assert pixels(with_pin) == pixels(unpinned)  # the same weights; the image names the pin it was made with
    assert json.loads(__import__("renderfleet.images", fromlist=["read_metadata"]).read_metadata(with_pin)["loras"]) == [
        [str(path), 1.0, pinned]
    ]
    make_tiny_lora(path, seed=3)  # retrained in place after the submit
    make_tiny_lora(folder / "pytorch_lora_weights.safetensors", seed=4)
    # this worker loaded the pinned bytes before: it renders them still
    assert renderer.render([prompt(loras=((str(path), 1.0, pinned),))])[0] == with_pin
    fresh = LoraCache(tiny.pipe)  # another worker: refuses, one line naming both digests, nothing loaded
    for source, pin in ((path, pinned), (folder, pinned_folder)):
        with pytest.raises(JobError, match="changed since the job was submitted") as exc:
            fresh.use([(str(source), 1.0, pin)])
        assert "\n" not in str(exc.value) and pin in str(exc.value)
    assert fresh.warm == []
    with pytest.raises(JobError, match="changed since"):  # a file's pin, a folder found: not that content
        fresh.use([(str(folder), 1.0, pinned)])
    # the new content under its own pin: another adapter beside the old one
    renderer.render([prompt(loras=((str(path), 1.0, file_digest(path)),))])
    assert renderer.loras.warm == [str(path)] * 3 and renderer.loras.loads == 3  # pinned, unpinned, new
    tiny.pipe.delete_adapters(list(renderer.loras._warm.values()))


class RecordingPipe:
    """A pipeline that records what it is asked to load (the hub, which this machine cannot reach)."""

    def __init__(self) -> None:
        self.asked: list[tuple[object, dict[str, object]]] = []
        self.names: list[str] = []

    def load_lora_weights(self, where: object, *, adapter_name: str, **options: object) -> None:
        self.asked.append((where, options))
        self.names.append(adapter_name)

    def get_list_adapters(self) -> dict[str, list[str]]:
        return {"unet": list(self.names)}

    def enable_lora(self) -> None: ...

    def set_adapters(self, names: list[str], adapter_weights: list[float]) -> None: ...


@pytest.mark.parametrize(
    ("source", "where", "options"),
    [
        ("owner/style", "owner/style", {}),
        ("owner/style/ink.safetensors", "owner/style", {"weight_name": "ink.safetensors"}),
        ("owner/pack/sd15/v2/ink.safetensors", "owner/pack", {"weight_name": "ink.safetensors", "subfolder": "sd15/v2"}),
        ("owner/pack/sd15/ink", "owner/pack", {"weight_name": "pytorch_lora_weights.safetensors", "subfolder": "sd15/ink"}),
    ],
)
def test_a_hub_lora_in_a_subfolder_is_asked_for_by_repo_subfolder_and_file_at_its_pinned_commit(
    source: str, where: str, options: dict[str, object]
) -> None:
    pipe = RecordingPipe()
    LoraCache(pipe).use([(source, 1.0, "hub-commit:" + "e" * 40)])
    LoraCache(pipe).use([(source, 1.0)])  # unpinned (no hub at submit): the hub's default branch
    assert pipe.asked == [
        (where, {"use_safetensors": True, **options, "revision": "e" * 40}),
        (where, {"use_safetensors": True, **options}),
    ]
    with pytest.raises(JobError, match="changed since"):  # submit saw a local file; this worker has none
        LoraCache(pipe).use([(source, 1.0, "file-sha256:" + "0" * 64)])
