"""The render settings users choose: scheduler names, long prompts, image formats.

Through the one table (spec.FIELDS) at submit and on the worker, and rendered with the
tiny model (random weights, 32x32, 2 steps: fast; its images are noise, but noise that
depends on every setting exactly as a real model's image would).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import json
import logging
from typing import Any

import pytest

from dispatcher.jobs.submit import SubmitOptions, check_options, job_id
from renderfleet import families, images, samplers, spec
from renderfleet.errors import InputError, JobError
from renderfleet.prompts.checks import check_json_object, parse_csv_cells
from renderfleet.spec import Prompt, RenderParams, message_problems
from testing.messages import message_dict

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from worker.render.models import LoadedModel, load_pipeline  # noqa: E402
from worker.render.pipeline import Renderer, SchedulerCache  # noqa: E402

# The samplers the issue lists, and the rest of the common names: every one renders.
LISTED = ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "dpmpp_sde", "ddim", "unipc", "lcm")


def prompt(**changes: Any) -> Prompt:
    return dataclasses.replace(Prompt(0, "000000", "a red fox", "blurry", 5, 2, 7.5, 32, 32), **changes)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)  # bytes compared below: the same thread count throughout
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def renderer(tiny: LoadedModel) -> Renderer:
    return Renderer(tiny, batch_invariant=True)


def pixels(data: bytes) -> bytes:
    """An image file's pixels, without its metadata."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.tobytes()


# ---- names and checks: no model ------------------------------------------------------


def test_every_common_scheduler_name_is_a_diffusers_class_with_real_options() -> None:
    for name, (cls_name, options) in samplers.COMMON.items():
        cls = getattr(diffusers, cls_name)
        config_keys = set(inspect.signature(cls.__init__).parameters)
        assert set(options) <= config_keys, name
    assert samplers.resolve("dpmpp_2m_karras") == ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True})
    assert samplers.resolve("euler_a") == ("EulerAncestralDiscreteScheduler", {})
    assert samplers.resolve("UniPCMultistepScheduler") == ("UniPCMultistepScheduler", {})
    assert samplers.scheduler_problem("") is None  # the pipeline's own
    why = samplers.scheduler_problem("dpmpp_9m")
    assert why and "unknown scheduler 'dpmpp_9m'" in why and "dpmpp_2m_karras" in why
    # a mistyped name gets the closest (issue 46); a name like none, none
    assert "unknown scheduler 'eulr': did you mean 'euler' or 'euler_a'? one of" in (
        samplers.scheduler_problem("eulr") or ""
    )
    assert "did you mean 'EulerDiscreteScheduler'" in (samplers.scheduler_problem("EulerDiscreteSchedular") or "")
    assert "did you mean" not in (samplers.scheduler_problem("warp") or "did you mean")


def test_a_prompt_file_sets_a_scheduler_per_prompt_and_a_bad_one_is_refused_by_name() -> None:
    good = {"prompt": "a cat", "scheduler": "euler_a"}
    assert check_json_object(good) == []
    assert check_json_object({"prompt": "a cat", "scheduler": "warp"})[0].startswith("unknown scheduler 'warp'")
    # the job's settings are flags, never a prompt's column
    assert check_json_object({"prompt": "a cat", "image_format": "webp"}) == ["unknown field 'image_format'"]
    row, reasons = parse_csv_cells(["prompt", "scheduler"], ["a cat", "ddim"])
    assert row == {"prompt": "a cat", "scheduler": "ddim"} and reasons == []
    assert spec.prompt_json({"prompt": "a", "scheduler": "lcm"}) == '{"p":"a","sch":"lcm"}'
    assert Prompt.from_wire(0, {"p": "a", "sch": "lcm"}, RenderParams()).scheduler == "lcm"


def test_submit_names_each_bad_setting_and_the_worker_refuses_the_same() -> None:
    bad = RenderParams(scheduler="warp", long_prompts="drop", image_format="gif", quality=0)
    with pytest.raises(InputError) as info:
        check_options(SubmitOptions(params=bad))
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == ["--scheduler", "--long-prompts", "--image-format", "--quality"]
    assert "image_format must be one of png, webp, webp-lossless, jpeg, got 'gif'" in problems[2]
    job = spec.JobSpec(job="j-0123456789abcdef", params=bad, total=1, shard_size=1, batch_size=1)
    msg = spec.ShardMessage(job.job, 0, bad, 1, "renderfleet.default.0123456789ab", (prompt(),), count=1)
    found = message_problems(message_dict(msg))
    assert len(found) == 4 and all(p.startswith("params: ") for p in found)
    # a prompt's own sampler comes from the job's wire file (shards by reference): the renderer refuses
    # a name it does not know as the job's error, never the node's
    with pytest.raises(JobError, match="unknown scheduler 'warp'"):
        SchedulerCache(None).get("warp")


def test_a_job_id_keeps_its_value_unless_a_new_setting_is_set() -> None:
    params = RenderParams(model="tiny", steps=2, width=32, height=32)
    old_form = {k: v for k, v in params.to_dict().items() if k not in spec.SET_ONLY_IDENTITY}
    ident = json.dumps({"content": "abc", "params": old_form, "store": "/data"}, sort_keys=True)
    assert job_id("abc", params, "/data") == "j-" + hashlib.sha256(ident.encode()).hexdigest()[:16]
    ids = {
        job_id("abc", dataclasses.replace(params, **{name: value}), "/data")
        for name, value in [("scheduler", "euler"), ("long_prompts", "truncate"), ("image_format", "webp"), ("quality", 80)]
    }
    assert len(ids | {job_id("abc", params, "/data")}) == 5


def test_a_job_without_new_settings_keeps_the_message_and_spec_an_older_worker_reads() -> None:
    old_keys = {"model", "steps", "width", "height", "guidance", "negative_prompt", "seed"}
    job = spec.JobSpec(job="j-0123456789abcdef", params=RenderParams(), total=1, shard_size=1, batch_size=1)
    assert set(json.loads(job.to_json())["params"]) == old_keys
    head = json.loads(spec.message_encoder(job, "renderfleet.default.0123456789ab")(0))
    assert set(head["params"]) == old_keys
    webp = dataclasses.replace(job, params=RenderParams(image_format="webp"))
    assert spec.JobSpec.from_json(webp.to_json()) == webp
    assert json.loads(spec.message_encoder(webp, "q")(0))["params"]["image_format"] == "webp"


def test_every_format_has_its_extension_and_a_listing_recognises_each() -> None:
    assert [spec.image_key("j", "a", RenderParams(image_format=f).image_extension) for f in spec.IMAGE_FORMATS] == [
        "jobs/j/images/a.png",
        "jobs/j/images/a.webp",
        "jobs/j/images/a.webp",
        "jobs/j/images/a.jpg",
    ]
    assert [spec.image_name(t) for t in ("a.png", "b.webp", "c.jpg", "d.json", "e.png.tmp")] == ["a", "b", "c", None, None]


def test_submit_counts_long_prompts_once_naming_the_first_lines(tmp_path: Any) -> None:
    from renderfleet.prompts import long_prompts_note, validate_file
    from renderfleet.prompts.checks import over_clip_limit

    assert not over_clip_limit("x" * 500)  # one word: a tokenizer may make it anything; never warned without proof
    assert over_clip_limit(" ".join(["word"] * 76)) and not over_clip_limit(" ".join(["word"] * 75))
    long = ", ".join(["a red fox"] * 30)
    path = tmp_path / "p.txt"
    path.write_text("short\n" + f"{long}\n" * 5 + "# a comment\nshort again\n")
    summary = validate_file(str(path))
    assert (summary.long, summary.long_lines) == (5, (2, 3, 4))
    note = long_prompts_note(summary, "truncate")
    assert note == (
        f"{path}:2, {path}:3, {path}:4, ...: 5 prompt(s) longer than the CLIP text encoder's 77 tokens "
        "(counted without the model's tokenizer: at least this many): cut at 77 tokens, the rest "
        "ignored (long_prompts=truncate)"
    )
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a", "negative_prompt": long}) + "\n")
    assert "embedded in 77-token chunks" in (long_prompts_note(validate_file(str(jsonl)), "chunk") or "")
    assert long_prompts_note(validate_file(str(tmp_path / "p.jsonl")), "chunk", negative="") is not None
    short = tmp_path / "s.txt"
    short.write_text("a red fox\n")
    assert long_prompts_note(validate_file(str(short)), "chunk") is None
    assert "--negative: 1 prompt(s)" in (long_prompts_note(validate_file(str(short)), "chunk", negative=long) or "")
    # A T5 family reads past 77 tokens whatever the mode: the note says what it reads, not chunks.
    for family, tokens in ((families.SD3, 256), (families.FLUX, 512), (families.FLUX_SCHNELL, 256)):
        note = long_prompts_note(summary, "chunk", family=family) or ""
        assert f"CLIP encoder reads the first 77 tokens and its T5 encoder {tokens}" in note, note
        assert "chunks" not in note


# ---- rendering: the tiny model -----------------------------------------------------


@pytest.mark.parametrize("name", [*LISTED, "heun", "dpm2_a_karras", "dpmpp_2m_sde", "EulerDiscreteScheduler"])
def test_each_sampler_renders_the_same_bytes_twice_without_reloading_the_model(
    tiny: LoadedModel, renderer: Renderer, name: str
) -> None:
    pipe, unet = tiny.pipe, tiny.pipe.unet
    first = renderer.render([prompt(scheduler=name)])
    again = renderer.render([prompt(scheduler=name)])  # a redelivered batch
    assert first == again
    assert tiny.pipe is pipe and tiny.pipe.unet is unet  # switched on the loaded pipeline
    built = renderer.schedulers.get(name)
    assert type(built).__name__ == samplers.resolve(name)[0]
    assert renderer.schedulers.get(name) is built  # built once per name
    # the model's own schedule is kept: only the solver changes
    assert built.config.beta_schedule == renderer.schedulers.default.config.beta_schedule


def test_the_default_scheduler_is_the_pipelines_own_and_karras_sigmas_follow_the_name(renderer: Renderer) -> None:
    own = renderer.render([prompt()])
    assert renderer.render([prompt(scheduler="euler")]) != own
    renderer.render([prompt(scheduler="dpmpp_2m_karras")])
    assert renderer.render([prompt()]) == own  # back to the pipeline's own, same bytes
    assert renderer.schedulers.get("") is renderer.schedulers.default
    assert renderer.schedulers.get("dpmpp_2m_karras").config.use_karras_sigmas is True
    assert renderer.schedulers.get("dpmpp_2m").config.use_karras_sigmas is False


LONG = "a lighthouse at dusk, oil painting, waves breaking on black rocks. " * 3  # ~200 tokens on tiny


def test_a_long_prompt_is_chunked_by_default_and_cut_when_asked(
    renderer: Renderer, caplog: pytest.LogCaptureFixture
) -> None:
    # tiny's tokenizer is CLIP's, 77 tokens, one per character: LONG is three chunks
    assert renderer.long_prompts.limit == 77 and renderer.long_prompts.tokens(LONG) > 2 * 77
    chunked = renderer.render([prompt(prompt=LONG)])
    embeds = renderer.long_prompts.embed([prompt(prompt=LONG)])
    assert embeds and embeds[0] and embeds[0].chunks == 3 and embeds[0].negative.shape == embeds[0].prompt.shape
    with caplog.at_level(logging.WARNING):
        cut = renderer.render([prompt(prompt=LONG, long_prompts="truncate")])
        again = renderer.render([prompt(prompt=LONG[:100], long_prompts="truncate")])
    assert pixels(chunked[0]) != pixels(cut[0])
    # truncate is the pipeline's own cut: the same image as the prompt's first 75 tokens
    assert pixels(cut[0]) == pixels(again[0])
    # (tiny's words of three letters are three tokens: 25 of them are the 75 a chunk holds)
    words = " ".join(["red", "fox", "sky"] * 20)
    full, first = prompt(prompt=words, long_prompts="truncate"), prompt(prompt=" ".join(words.split()[:25]))
    assert renderer.long_prompts.tokens(first.prompt) == 77
    assert pixels(renderer.render([full])[0]) == pixels(renderer.render([first])[0])
    assert pixels(renderer.render([dataclasses.replace(full, long_prompts="chunk")])[0]) != pixels(
        renderer.render([first])[0]
    )
    # the pipeline's warning quotes every token cut: one short line per worker at most
    truncated = [r for r in caplog.records if "77 tokens" in r.getMessage() or "truncated" in r.getMessage()]
    assert len(truncated) <= 1 and all(len(r.getMessage()) < 200 for r in truncated)
    # a prompt within the limit is rendered from its text as before, chunking or not
    assert pixels(renderer.render([prompt(long_prompts="truncate")])[0]) == pixels(renderer.render([prompt()])[0])


def test_a_long_negative_prompt_is_chunked_too_and_a_batch_keeps_each_prompts_image(tiny: LoadedModel) -> None:
    batched = Renderer(tiny)
    short, long = prompt(), prompt(index=1, name="000001", seed=6, negative_prompt=LONG)
    together = batched.render([short, long])
    assert together[0] == batched.render([short])[0]  # the short one's call is its own
    assert together[1] == batched.render([long])[0]
    assert pixels(together[1]) != pixels(batched.render([dataclasses.replace(long, long_prompts="truncate")])[0])


@pytest.mark.parametrize("fmt", list(spec.IMAGE_FORMATS))
def test_each_format_keeps_prompt_seed_settings_and_model(renderer: Renderer, fmt: str) -> None:
    from PIL import Image

    p = prompt(prompt="héllo <世界> & co", scheduler="unipc", image_format=fmt, quality=80)
    data = renderer.render([p])[0]
    assert data == renderer.render([p])[0]  # no clock in any format
    meta = images.read_metadata(data)
    assert {k: meta[k] for k in ("prompt", "seed", "steps", "model", "scheduler", "quality")} == {
        "prompt": "héllo <世界> & co",
        "seed": "5",
        "steps": "2",
        "model": "tiny",
        "scheduler": "unipc",
        "quality": "80",
    }
    assert meta.get("image_format", "png") == fmt  # the default is written only where it is not
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == {"png": "PNG", "webp": "WEBP", "webp-lossless": "WEBP", "jpeg": "JPEG"}[fmt]
        assert image.size == (32, 32)


@pytest.mark.parametrize("text", ["bell\x07 and form feed\x0c", "carriage\r\nreturn", "\ufffe\uffff", "\x1b[31mred"])
def test_a_prompt_xml_cannot_carry_comes_back_whole_from_webp_and_jpeg(text: str) -> None:
    """Only NUL is refused at submit; other controls are legal in a prompt but not in XML text:
    the packet stays well-formed and every key comes back, the prompt exactly."""
    from PIL import Image

    meta = {"prompt": text, "seed": "5", "model": "tiny", "plain": "a & <b>"}
    packet = images.xmp_packet(meta)
    assert images.read_xmp(packet) == meta
    for fmt in ("webp", "jpeg"):
        data = images.encode(Image.new("RGB", (8, 8)), fmt, 90, meta)
        assert images.read_metadata(data) == meta, fmt


def test_a_png_of_default_settings_keeps_the_chunks_it_always_had(renderer: Renderer) -> None:
    meta = images.read_metadata(renderer.render([prompt()])[0])
    assert list(meta) == [
        "prompt",
        "negative_prompt",
        "seed",
        "steps",
        "guidance",
        "width",
        "height",
        "model",
        "renderfleet",
        "render_config",  # the configuration's digest (renderfleet/renderconfig.py): in every image (CHANGELOG)
    ]
