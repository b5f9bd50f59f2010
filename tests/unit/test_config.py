"""The pools config file: TOML read by pydantic-settings, the environment over it, errors naming file/key/value."""

from __future__ import annotations

from pathlib import Path

import pytest

from renderfleet.errors import ConfigError
from renderfleet.settings import load_settings

FLEET = """
store = "s3://bucket/renders"

[pools.baseline]
kind = "on-demand"
price_per_hour = 2.50
min = 1
max = 4

[pools.spot]
kind = "spot"
price_per_hour = 0.90
min = 0
max = 8
backend = "aws"
autoscaling_group = "rf-spot"
region = "us-east-1"

[autoscale]
drain_seconds = 300
cooldown_seconds = 60
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_pools_and_settings_come_from_the_file_and_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RENDERFLEET_CONFIG", str(write(tmp_path, FLEET)))
    monkeypatch.setenv("RENDERFLEET_AUTOSCALE__COOLDOWN_SECONDS", "30")
    monkeypatch.delenv("RENDERFLEET_STORE", raising=False)
    s = load_settings()
    assert s.store == "s3://bucket/renders"
    assert s.pools["baseline"].min == 1 and s.pools["spot"].kind == "spot"
    assert s.pools["spot"].autoscaling_group == "rf-spot" and s.pools["spot"].price_per_hour == 0.9
    assert s.autoscale.drain_seconds == 300 and s.autoscale.cooldown_seconds == 30
    monkeypatch.setenv("RENDERFLEET_STORE", "/data/out")
    assert load_settings().store == "/data/out"


def test_without_a_file_there_are_no_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RENDERFLEET_CONFIG", raising=False)
    assert load_settings().pools == {}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (FLEET.replace("max = 8", "max = -1"), "fleet.toml: pools.spot.max = -1: "),
        (FLEET.replace('kind = "spot"', 'kind = "cheap"'), "fleet.toml: pools.spot.kind = 'cheap': "),
        (FLEET.replace("min = 1", "min = 9"), "fleet.toml: pools.baseline: min (9) is above max (4)"),
        (FLEET.replace("drain_seconds", "drain_secs"), "fleet.toml: autoscale.drain_secs = 300: "),
        (FLEET + "\n[poolz]\n", "fleet.toml: unknown key 'poolz'"),
        ("pools = [", "fleet.toml: not valid TOML"),
    ],
)
def test_a_bad_config_file_names_the_file_the_key_and_the_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, needle: str
) -> None:
    monkeypatch.delenv("RENDERFLEET_CONFIG", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(config=str(write(tmp_path, text)))
    assert needle in str(err.value).replace(str(tmp_path) + "/", "")


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_settings(config=str(tmp_path / "nope.toml"))
