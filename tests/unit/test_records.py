"""Each prompt's record (dispatcher/jobs/records.py): from the checkpoints the runner writes, old ones included."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dispatcher.jobs.records import Rendered, record, rendered_by, shard_checkpoints
from dispatcher.status.status import results
from dispatcher.views.manifest import COLUMNS, manifest_rows
from renderfleet import spec
from renderfleet.spec import JobSpec, RenderParams
from renderfleet.store import LocalStore
from tests.unit.test_runner import FakeRenderer, MemLedger, make_msg
from worker.node.stop import StopSignal
from worker.render.runner import ShardRunner


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_a_prompts_record_is_the_checkpoint_of_the_attempt_that_rendered_it(store: LocalStore) -> None:
    msg, ledger = make_msg(4, 4), MemLedger()
    for attempt, bad in ((1, {"000002"}), (2, set())):  # prompt 2 fails on the first delivery, renders on the second
        run = ShardRunner(store=store, renderer=FakeRenderer(bad=bad, on_call=lambda n: time.sleep(0.01)), stop=StopSignal())
        run.card, run.pool = "NVIDIA H200", "spot"
        run.run(msg, ledger, attempt=attempt)
        run.close()
    facts = rendered_by(shard_checkpoints(store, "j", 0))
    assert {name: f.attempt for name, f in facts.items()} == {"000000": 1, "000001": 1, "000002": 2, "000003": 1}
    assert all(f.card == "NVIDIA H200" and f.pool == "spot" and f.seconds and f.seconds > 0 for f in facts.values())
    second = json.loads(store.get(spec.checkpoint_key("j", 0, 0, 2)) or b"{}")
    assert second["rendered"] == ["000002"] and len(second["done"]) == 4  # what it rendered, beside what it holds
    done = record("000002", {"000002"}, {}, facts["000002"], {"spot": 3.6})
    assert done["state"] == "done" and done["attempt"] == 2 and done["card"] == "NVIDIA H200"
    assert done["cost"] == pytest.approx(facts["000002"].seconds * 3.6 / 3600, rel=1e-3)


def test_a_checkpoint_from_before_records_gives_the_attempt_and_nothing_made_up() -> None:
    old = [
        {"batch": 0, "done": ["a", "b"], "quarantined": [], "attempt": 3},
        {"batch": 0, "done": ["a"], "quarantined": [], "attempt": 1},  # read in any order: the first attempt wins
    ]
    new = {"batch": 0, "done": ["a", "b", "c"], "attempt": 4, "rendered": ["c"], "card": "L4", "pool": "spot"}
    new["seconds_per_image"] = 0.5
    facts = rendered_by([*old, new])
    assert facts["a"] == Rendered(attempt=1) and facts["b"] == Rendered(attempt=3)  # carried over by 4: not its
    assert facts["c"] == Rendered(4, "L4", "spot", 0.5)
    assert record("a", {"a"}, {}, facts["a"], {"spot": 3.6}) == {
        "state": "done",
        "attempt": 1,
        "card": None,
        "pool": None,
        "seconds": None,
        "cost": None,  # never a cost of 0 for want of data
    }
    # Rendered twice (its image deleted, rendered again): the latest attempt's; a malformed field is absent.
    again = {"batch": 0, "done": ["c"], "attempt": 6, "rendered": ["c"], "card": 7, "seconds_per_image": "fast"}
    assert rendered_by([new, again])["c"] == Rendered(6, None, None, None)


def test_record_states_and_costs() -> None:
    facts = Rendered(2, "NVIDIA H200", "spot", 0.36)
    assert record("x", {"x"}, {}, facts, {"spot": 10.0})["cost"] == pytest.approx(0.001)
    assert record("x", {"x"}, {}, facts, {"baseline": 10.0})["cost"] is None  # its pool has no price
    assert record("x", {"x"}, {"x": "NaN in latents"}, facts, {})["state"] == "done"  # an image wins
    assert record("y", set(), {"y": "NaN in latents"}, None, {}) == {"state": "quarantined", "error": "NaN in latents"}
    assert record("z", set(), {}, None, {}) == {"state": "pending"}


def test_results_and_the_manifest_give_each_prompts_record_in_order(store: LocalStore, tmp_path: Path) -> None:
    job = JobSpec(
        job="j-r",
        params=RenderParams(model="tiny"),
        total=5,
        shard_size=2,
        batch_size=2,
        pool="spot",
        prompts_key=spec.source_key("j-r", "txt", False),
    )
    (tmp_path / "p.txt").write_text("".join(f"p{i}\n" for i in range(5)))
    store.put_file(job.prompts_key, tmp_path / "p.txt")
    store.put(spec.spec_key(job.job), job.to_json().encode())
    for name in ("000000", "000001", "000003"):
        store.put(spec.image_key(job.job, name), b"png")
    shard0 = {"batch": 0, "done": ["000000", "000001"], "attempt": 1, "rendered": ["000000", "000001"]}
    shard0.update(card="L4", pool="spot", seconds_per_image=0.5)
    store.put(spec.checkpoint_key(job.job, 0, 0, 1), json.dumps(shard0).encode())
    old = {"batch": 0, "done": ["000003"], "quarantined": ["000002"], "attempt": 2}  # written before records
    store.put(spec.checkpoint_key(job.job, 1, 0, 2), json.dumps(old).encode())
    store.put(spec.quarantine_key(job.job, "000002"), json.dumps({"error": "bad prompt", "failures": 3}).encode())

    res = results(store, job.job, prices={"spot": 3.6})
    assert res.prompts is not None and list(res.prompts) == ["000000", "000001", "000002", "000003", "000004"]
    first = {"state": "done", "attempt": 1, "card": "L4", "pool": "spot", "seconds": 0.5, "cost": 0.0005}
    assert res.prompts["000000"] == first  # 0.5 s at $3.60 an hour
    assert res.prompts["000002"] == {"state": "quarantined", "error": "bad prompt"}
    assert res.prompts["000003"]["attempt"] == 2 and res.prompts["000003"]["card"] is None
    assert res.prompts["000004"] == {"state": "pending"}
    assert "prompts" not in results(store, job.job).to_dict()  # not asked: not read, not in the JSON

    rows = list(manifest_rows(store, job.job, prices={"spot": 3.6}))
    assert set(rows[0]) == set(COLUMNS)
    assert [(r["status"], r["attempt"], r["card"]) for r in rows] == [
        ("done", 1, "L4"),
        ("done", 1, "L4"),
        ("quarantined", None, None),
        ("done", 2, None),
        ("missing", None, None),
    ]


def test_a_stored_spec_is_read_once_the_same_way_for_resume_and_for_a_worker(store: LocalStore) -> None:
    """``spec.stored_spec``: None where the store holds no spec; the spec where it holds one; BadRecord naming
    the key for bytes that are no spec, and for one over its cap (read by no one: a worker whose Redis lost the
    job used to let that RecordTooLarge out of its fence check)."""
    from renderfleet.errors import BadRecord
    from renderfleet.limits import MAX_SPEC_BYTES

    assert spec.stored_spec(store, "j-1") is None
    params = RenderParams(model="tiny", steps=2, guidance=7.5, width=32, height=32, seed=1)
    store.put(
        spec.spec_key("j-1"),
        JobSpec(job="j-1", params=params, total=1, shard_size=1, batch_size=1, life="L1").to_json().encode(),
    )
    found = spec.stored_spec(store, "j-1")
    assert found is not None and found.life == "L1"
    for planted in (b"not json", b" " * (MAX_SPEC_BYTES + 1)):
        store.put(spec.spec_key("j-2"), planted)
        with pytest.raises(BadRecord, match=r"jobs/j-2/spec\.json"):
            spec.stored_spec(store, "j-2")
