"""A render configuration (renderfleet/renderconfig.py): its digest, its record, what it says of a difference."""

from __future__ import annotations

import dataclasses
import json

import pytest

from renderfleet import formats
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
