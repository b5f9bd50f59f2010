"""The Lua scripts spell the named states as literals: they must be exactly the enums' values."""

from __future__ import annotations

import re
from importlib import resources

from renderfleet.states import Beat, ClaimAnswer, Fence, Release, ShardState

LUA = resources.files("renderfleet") / "lua"
SCRIPTS = sorted(p.name for p in LUA.iterdir() if p.name.endswith(".lua"))


def code(name: str) -> str:
    """A script without its comments (headers name the states in prose)."""
    return "\n".join(line.split("--", 1)[0] for line in (LUA / name).read_text().splitlines())


def shard_states_written(name: str) -> set[str]:
    # Every write of a shard's state: HSET <the job's shards hash>, shard, '<state>'.
    return set(re.findall(r"HSET', (?:shards|job_prefix \.\. job \.\. shards_suffix), shard, '([^']*)'", code(name)))


def test_every_shard_state_a_script_writes_is_a_shard_state() -> None:
    written: set[str] = set()
    for name in SCRIPTS:
        states = shard_states_written(name)
        assert states <= set(ShardState), f"{name} writes shard states {states - set(ShardState)}"
        written |= states
    assert written == set(ShardState)


def test_claim_answers_are_exactly_the_claim_enum() -> None:
    answers = set(re.findall(r"return \{'([^']*)', ", code("claim.lua")))
    assert answers == set(ClaimAnswer)


def test_heartbeat_answers_are_exactly_the_beat_enum() -> None:
    answers = {int(n) for n in re.findall(r"return (\d+)", code("heartbeat.lua"))}
    assert answers == set(Beat)


def test_fence_answers_are_exactly_the_fence_enum() -> None:
    answers = {int(n) for n in re.findall(r"return (\d+)", code("fence.lua"))}
    assert answers == set(Fence)


def test_release_outcomes_are_exactly_the_release_enum() -> None:
    # release.lua tests for 'done' and 'front'; anything else is the back of the queue.
    compared = re.findall(r"outcome == '([^']*)'", code("release.lua"))
    assert len(compared) == len(set(compared))
    assert set(compared) | {Release.BACK} == set(Release) and Release.BACK not in compared


def test_no_script_compares_a_shard_state_to_an_unknown_literal() -> None:
    for name in SCRIPTS:
        read = set(re.findall(r"HGET', (?:shards|job_prefix \.\. job \.\. shards_suffix), shard\) == '([^']*)'", code(name)))
        assert read <= set(ShardState), name
