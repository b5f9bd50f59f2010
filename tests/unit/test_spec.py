"""The contract: wire form, seeds, batches at fixed positions, job identity, shard messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispatcher.jobs.resume import stored_prompts
from dispatcher.jobs.submit import SubmitOptions, check_options, job_id
from renderfleet import shardfile, spec
from renderfleet.celery_app import is_store_queue, queue_name
from renderfleet.errors import InputError
from renderfleet.prompts import detect_format, iter_wire, validate_file
from renderfleet.spec import JobSpec, Prompt, RenderParams, ShardMessage, message_problems
from renderfleet.store import LocalStore
from testing.messages import message_dict, message_json, to_wire

PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32, guidance=7.5, negative_prompt="blur", seed=9)


def test_derived_seed_is_stable_and_depends_on_job_seed_and_index() -> None:
    assert spec.derive_seed(0, 0) == spec.derive_seed(0, 0)
    assert len({spec.derive_seed(s, i) for s in range(3) for i in range(100)}) == 300
    # pinned: changing the derivation would change every image of every resubmitted job
    assert (
        spec.derive_seed(0, 0)
        == int.from_bytes(__import__("hashlib").blake2b(b"0:0", digest_size=8).digest(), "big") & 0x7FFF_FFFF_FFFF_FFFF
    )


def test_wire_form_is_compact_and_round_trips() -> None:
    plain = Prompt(3, "000003", "a cat", "blur", spec.derive_seed(9, 3), 2, 7.5, 32, 32)
    assert to_wire(plain, PARAMS) == "a cat"
    custom = Prompt(4, "hero", "a dog", "", 42, 10, 3.0, 64, 48)
    wire = to_wire(custom, PARAMS)
    assert wire == {"p": "a dog", "s": 42, "n": "hero", "neg": "", "steps": 10, "g": 3.0, "w": 64, "h": 48}
    assert Prompt.from_wire(4, wire, PARAMS) == custom
    assert Prompt.from_wire(3, to_wire(plain, PARAMS), PARAMS) == plain


def test_shard_message_built_by_the_dispatcher_decodes_on_the_worker() -> None:
    job = JobSpec(job="j-1", params=PARAMS, total=5, shard_size=5, batch_size=2)
    wire = [json.dumps(f"p{i}") for i in range(5)]
    msg = ShardMessage.from_dict(json.loads(message_json(job, queue_name("default", "/data/a"), 0)))
    assert msg.job == "j-1" and msg.shard == 0 and msg.batch_size == 2 and msg.params == PARAMS
    assert (msg.first, msg.count, msg.prompts) == (0, 5, ())  # by reference: the worker reads its prompts
    msg = msg.with_prompts([json.loads(w) for w in wire])
    assert [p.name for p in msg.prompts] == [f"{i:06d}" for i in range(5)]
    # batches sit at fixed positions, whatever is already done
    assert [(n, [p.index for p in b]) for n, b in msg.batches()] == [(0, [0, 1]), (1, [2, 3]), (2, [4])]


def test_job_id_follows_content_settings_and_store_not_how_the_work_is_cut() -> None:
    one = job_id("abc", PARAMS, "/data/a")
    assert one == job_id("abc", PARAMS, "/data/a") and one.startswith("j-")
    assert one != job_id("abd", PARAMS, "/data/a")
    assert one != job_id("abc", RenderParams(model="tiny", steps=3, width=32, height=32, seed=9), "/data/a")
    # a job belongs to one store: the same prompts sent to another store are another job
    assert one != job_id("abc", PARAMS, "/data/b")
    assert job_id("abc", PARAMS, "s3://bucket/renders/") == job_id("abc", PARAMS, "s3://bucket/renders")


def test_shard_message_names_its_store_and_older_messages_name_none() -> None:
    job = JobSpec(job="j-1", params=PARAMS, total=1, shard_size=1, batch_size=1)
    assert ShardMessage.from_dict(json.loads(message_json(job, "q", 0, "s3://b/p"))).store == "s3://b/p"
    data = json.loads(message_json(job, "q", 0))
    del data["store"]
    assert ShardMessage.from_dict(data).store == ""


def test_a_queue_is_named_by_pool_and_store_stably_and_safely() -> None:
    a = queue_name("spot", "s3://bucket/renders")
    # 12 hex digits of the store's identity: the same for the same store however written, never the URL itself
    assert a == queue_name("spot", "s3://bucket/renders/") == f"renderfleet.spot.{spec.store_tag('s3://bucket/renders')}"
    assert a == "renderfleet.spot.c1df3521d878"  # stable across versions: a fleet's workers and dispatcher agree
    assert queue_name("spot", "s3://bucket/other") != a and queue_name("default", "s3://bucket/renders") != a
    assert queue_name("spot", "s3://user:secret@host/b").count("secret") == 0
    job = JobSpec(job="j-1", params=PARAMS, total=1, shard_size=1, batch_size=1)
    assert message_problems(json.loads(message_json(job, a, 0, "s3://bucket/renders"))) == []
    # the store's own queues only; an older version's queue (no store) is no store's
    assert is_store_queue(a, "s3://bucket/renders/") and not is_store_queue(a, "s3://bucket/other")
    for other in ("renderfleet.spot", f"renderfleet.{spec.store_tag('s3://bucket/renders')}", "rf:queues", ""):
        assert not is_store_queue(other, "s3://bucket/renders")


@pytest.mark.parametrize("bad", ["", "../etc", ".hidden", "a/b", "x" * 101, "東京"])
def test_a_job_id_that_could_leave_its_prefix_is_refused(bad: str) -> None:
    assert spec.job_id_problem(bad) is not None
    assert spec.job_id_problem("j-0123abcd_v2.1") is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"params": RenderParams(steps=0)}, "--steps"),
        ({"params": RenderParams(width=30)}, "--size"),
        ({"params": RenderParams(guidance=-1)}, "--guidance"),
        ({"shard_size": 0}, "--shard-size"),
        ({"batch_size": 0}, "--batch-size"),
        ({"job": "../etc"}, "--job"),
    ],
)
def test_bad_flags_are_named(kwargs: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {"params": RenderParams()}
    with pytest.raises(InputError, match=needle):
        check_options(SubmitOptions(**{**base, **kwargs}))  # type: ignore[arg-type]


def test_spec_round_trips_through_json() -> None:
    job = JobSpec(job="j", params=PARAMS, total=130, shard_size=64, batch_size=4, pool="spot", source="p.txt")
    assert JobSpec.from_json(job.to_json()) == job
    assert job.shards == 3 and list(job.shard_range(2)) == [128, 129]


def plain(index: int, text: str, **changes: object) -> Prompt:
    """Prompt ``index`` of a file under PARAMS, with ``changes`` to the job's values."""
    fields = {
        "index": index,
        "name": spec.index_name(index),
        "prompt": text,
        "negative_prompt": "blur",
        "seed": spec.derive_seed(9, index),
        "steps": 2,
        "guidance": 7.5,
        "width": 32,
        "height": 32,
    }
    return Prompt(**{**fields, **changes})  # type: ignore[arg-type]


# Every origin of a shard, with the prompts it must decode to.  Quotes,
# backslashes and non-ASCII text test the hand-made escaping.
ORIGINS: dict[str, tuple[str, list[Prompt]]] = {
    "p.txt": ('a cat\n# skip\n\n  a "dög" \\ ☕  \n', [plain(0, "a cat"), plain(1, 'a "dög" \\ ☕')]),
    "p.jsonl": (
        '{"prompt": "a cat", "id": 7, "seed": 5}\n'
        '{"prompt": "a \\"dög\\"", "steps": 4, "guidance": 3, "width": 64, "height": 48, '
        '"negative_prompt": "", "id": "héro"}\n',
        [
            plain(0, "a cat", name="7", seed=5),
            plain(1, 'a "dög"', name="héro", steps=4, guidance=3.0, width=64, height=48, negative_prompt=""),
        ],
    ),
    "p.csv": (
        'prompt,id,seed,steps,guidance,negative_prompt\na cat,x1,,3,,\n"a, ""dog""",,9,,0.5,sharp\n',
        [plain(0, "a cat", name="x1", steps=3), plain(1, 'a, "dog"', seed=9, guidance=0.5, negative_prompt="sharp")],
    ),
}


@pytest.mark.parametrize("name", ORIGINS)
def test_a_shard_has_one_wire_form_from_submit_or_resume_that_round_trips_with_the_slow_encoding(
    tmp_path: Path, name: str
) -> None:
    content, expected = ORIGINS[name]
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    total = validate_file(str(path)).total
    job = JobSpec(
        job="j-1",
        params=PARAMS,
        total=total,
        shard_size=total,
        batch_size=1,
        prompts_key=spec.source_key("j-1", *detect_format(str(path))),
    )
    store = LocalStore(tmp_path / "store")
    store.put_file(job.prompts_key, path)
    encode = spec.message_encoder(job, queue_name("default", store.url), store.url)

    # 1. Submit's wire file of the file and resume's reading of the stored copy: the same lines,
    #    and a worker reads the shard's range of it back through the index.
    writer, cut = shardfile.write_files(iter_wire(str(path)), job.shard_size, tmp_path / "wire.jsonl")
    assert cut == [(0, total)]
    lines = (tmp_path / "wire.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines == [line for _, line in stored_prompts(store, job)]
    store.put_file(spec.wire_key(job.job), tmp_path / "wire.jsonl")
    store.put(spec.wire_index_key(job.job), writer.index())
    read = shardfile.ShardReader(store).read(job, 0)

    # 2. The message is what json.dumps writes of the same shard, and decodes to its prompts.
    fast = json.loads(encode(0))
    msg = ShardMessage.from_dict(fast)
    assert fast == message_dict(msg) and message_problems(fast) == []
    assert ShardMessage.from_dict(message_dict(msg)) == msg
    assert read is not None and spec.wire_problems(0, read) == []
    assert msg.with_prompts(read).prompts == tuple(expected)


def test_the_apis_prompt_request_names_exactly_the_fields_of_the_one_table() -> None:
    """PromptRequest spells its fields out for users' type checkers; the table stays the one definition."""
    from dataclasses import fields

    from renderfleet.api import PromptRequest

    assert [f.name for f in fields(PromptRequest)] == [f.name for f in spec.PROMPT_FIELDS]
    every = PromptRequest(
        "a cat",
        id="c",
        negative_prompt="n",
        seed=1,
        steps=2,
        guidance=3.0,
        width=8,
        height=16,
        scheduler="euler",
        skip_stages="2",
    )
    assert set(every.to_dict()) == {f.name for f in spec.PROMPT_FIELDS}
