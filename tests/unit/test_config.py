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
        (FLEET.replace("max = 8", "max = 8\ngpus_per_node = 0"), "fleet.toml: pools.spot.gpus_per_node = 0: "),
        (FLEET.replace("max = 8", "max = 8\ngpus_per_node = 'four'"), "pools.spot.gpus_per_node = 'four': "),
        (FLEET.replace("max = 8", "max = 8\nprice_per = 'hour'"), "fleet.toml: pools.spot.price_per = 'hour': "),
        (
            FLEET.replace("max = 8", "max = 6\ngpus_per_node = 4"),
            "fleet.toml: pools.spot: max = 6 is not a whole number of nodes of gpus_per_node = 4 GPUs "
            "(max counts GPUs, a worker each): give 4 or 8",
        ),
        (FLEET.replace("max = 4", "max = 8\ngpus_per_node = 8"), "pools.baseline: min = 1 is not a whole number"),
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


def test_a_pool_of_nodes_prices_its_gpus_once_whatever_its_price_is_per(tmp_path: Path) -> None:
    """price_per = "node": the node's price divided by its GPUs, in one place (gpu_price_per_hour), which
    is what every cost reads (the published prices, budgets, the estimate, the waste's all-in cost)."""
    text = FLEET.replace(
        "price_per_hour = 0.90\nmin = 0\nmax = 8",
        'price_per_hour = 4.0\nprice_per = "node"\ngpus_per_node = 4\nmin = 0\nmax = 16',
    )
    s = load_settings(config=str(write(tmp_path, text)))
    spot, base = s.pools["spot"], s.pools["baseline"]
    assert (spot.gpus_per_node, spot.price_per, spot.gpu_price_per_hour) == (4, "node", 1.0)
    assert (base.gpus_per_node, base.price_per, base.gpu_price_per_hour) == (1, "gpu", 2.5)  # the defaults
    assert s.gpu_prices == {"baseline": 2.5, "spot": 1.0}
    # Per GPU, a pool of nodes keeps its price as written.
    assert spot.model_copy(update={"price_per": "gpu"}).gpu_price_per_hour == 4.0
    # GPUs to nodes: rounded up, a part of a node is a node.
    assert [spot.nodes(g) for g in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
