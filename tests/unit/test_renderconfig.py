"""A render configuration (renderfleet/renderconfig.py): its digest, its record, what it says of a difference."""

from __future__ import annotations

import dataclasses
import json

import pytest

from renderfleet import formats, renderconfig
from renderfleet.renderconfig import MAX_BYTES, RenderConfig

CPU = RenderConfig(
    device="cpu",
    arch="x86_64",
    dtype="float32",
    quantize="none",
    compile="none",
    attention="sdpa",
    threads=1,
    batch_invariant=False,
    torch="2.13.0",
    diffusers="0.42.1",
)


def test_the_digest_is_the_fields_and_every_field_changes_it() -> None:
    assert CPU.digest == dataclasses.replace(CPU).digest and len(CPU.digest) == 16
    others = {
        "threads": 2,
        "batch_invariant": True,
        **{f.name: "other" for f in dataclasses.fields(CPU) if f.name not in ("threads", "batch_invariant")},
    }
    digests = {dataclasses.replace(CPU, **{name: value}).digest for name, value in others.items()}
    assert len(digests) == len(others) and CPU.digest not in digests


def test_a_record_reads_back_and_one_that_is_not_ours_is_refused_naming_why() -> None:
    assert RenderConfig.from_json(CPU.to_json()) == CPU
    record = json.loads(CPU.to_json())
    assert record[formats.KEY] == formats.RENDER_CONFIG and record["digest"] == CPU.digest
    for broken, why in (
        ({**record, "threads": "1"}, "threads is not a int"),
        ({**record, "quantize": None}, "quantize is not a str"),
        ({**record, "digest": "0" * 16}, "its digest"),
        ({k: v for k, v in record.items() if k != "dtype"}, "dtype is not a str"),
        ({**record, formats.KEY: formats.RENDER_CONFIG + 1}, "upgrade this worker first"),
    ):
        with pytest.raises(ValueError, match=why):
            RenderConfig.from_json(json.dumps(broken))
    for raw in ("[]", "not json", " " * (MAX_BYTES + 1)):
        with pytest.raises(ValueError):
            RenderConfig.from_json(raw)


def test_what_a_refusal_and_status_say() -> None:
    other = dataclasses.replace(CPU, threads=2, quantize="int8")
    assert CPU.differences(other) == ["quantize: none (this worker: int8)", "threads: 1 (this worker: 2)"]
    assert CPU.summary() == f"{CPU.digest} (cpu, float32, 1 threads)"
    card = dataclasses.replace(CPU, device="cuda", arch="sm_90", dtype="bfloat16", threads=0, compile="regional")
    assert card.summary() == f"{card.digest} (cuda sm_90, bfloat16, compile regional)"


def test_a_job_that_asks_for_a_recipe_is_another_job_and_keeps_its_ask_out_of_what_older_workers_read() -> None:
    """``submit --quantize``: other bytes, so another id (an ask of none leaves the id as before recipes);
    the spec's JSON names it, the registration an older worker parses does not (keys.job's field holds it)."""
    from dispatcher.jobs.submit import job_id
    from renderfleet.spec import JobSpec, RenderParams, spec_problems

    params = RenderParams(model="tiny")
    plain = job_id("d" * 64, params, "file:///s")
    assert job_id("d" * 64, params, "file:///s", "") == plain
    assert (
        len({plain, job_id("d" * 64, params, "file:///s", "fp8-dynamic"), job_id("d" * 64, params, "file:///s", "int8")})
        == 3
    )
    asked = JobSpec(job="j-1", params=params, total=1, shard_size=1, batch_size=1, quantize="fp8-dynamic")
    assert json.loads(asked.to_json())["quantize"] == "fp8-dynamic" and "quantize" not in json.loads(asked.registration())
    assert "quantize" not in json.loads(dataclasses.replace(asked, quantize="").to_json())
    assert JobSpec.from_json(asked.to_json()) == asked
    data = json.loads(asked.to_json())
    assert spec_problems(data) == []
    assert spec_problems({**data, "quantize": "int4"}) == [
        "quantize: must be one of none, int8, fp8, int8-dynamic, fp8-dynamic, got 'int4'"
    ]


def test_the_feeder_lists_each_live_workers_recipe_beside_its_digest_and_a_refusal_names_both() -> None:
    from renderfleet.feeder import live_configs, queue_name

    def registration(digest: str, recipe: object) -> str:
        return json.dumps({"pool": "p", "store": "file:///s", "render_config": digest, "quantize": recipe})

    found = live_configs({"a": registration("aa11", "fp8-dynamic"), "b": registration("bb22", "int4"), "c": "{"})
    assert found[queue_name("p", "file:///s")] == {"aa11", "q:fp8-dynamic", "bb22"}  # no recipe of ours: no mark
    assert renderconfig.asked_refusal("", "none") is None and renderconfig.asked_refusal("int8", "int8") is None
    assert renderconfig.asked_refusal("fp8-dynamic", "none") == (
        "its job asks for --quantize fp8-dynamic, this worker renders with --quantize none"
    )


def test_an_attention_preference_is_cudas_and_orders_the_kernels_it_names_first() -> None:
    """``RENDERFLEET_ATTENTION`` (issue 48, item 2): refused off CUDA and where it is no preference, named in
    the render configuration; on a card each call runs inside torch's ``sdpa_kernel`` in that order."""
    from renderfleet.errors import ConfigError
    from renderfleet.settings import Settings
    from worker.render.models.cuda import attention_kernels, attention_order, check_attention

    assert Settings(attention=" CUDNN ").attention == "cudnn"
    with pytest.raises(ValueError, match="must be one of auto, flash, cudnn, efficient, got 'fa3'"):
        Settings(attention="fa3")
    check_attention("auto", "cpu")
    check_attention("cudnn", "cuda:0")
    with pytest.raises(ConfigError, match=r"RENDERFLEET_ATTENTION=cudnn .* this worker renders on 'cpu': leave it auto"):
        check_attention("cudnn", "cpu")
    assert attention_order("cudnn") == "cudnn>flash>efficient>math"
    import torch
    from torch.nn.attention import SDPBackend

    before = torch._C._get_sdp_priority_order()
    with attention_kernels("cudnn"):
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
    assert torch._C._get_sdp_priority_order() == before  # undone: nothing process-wide
    with attention_kernels("auto"):
        assert torch._C._get_sdp_priority_order() == before
