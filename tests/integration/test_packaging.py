"""The packaging as shipped: the wheel's contents and import names, the licence, and the images'
build files (dependency layers before the source, an allow-list .dockerignore, digest-pinned bases,
a health check where the image serves HTTP, a GPU for each compose worker)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from testing.fleet import REPO

pytestmark = pytest.mark.integration
DOCKER = REPO / "docker"
PACKAGES = ("renderfleet", "dispatcher", "worker")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel --no-deps`` of a copy of what the images copy (no network: the venv's setuptools)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("renderfleet-*.whl")
    return found


def test_the_wheel_installs_the_three_packages_as_they_are_named_today(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    (info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
    top = zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split()
    # docs/development.md: `dispatcher` and `worker` are generic names other distributions use too;
    # why they are not remapped under renderfleet. yet, and the plan. A change here is a decision.
    assert sorted(top) == sorted(PACKAGES)
    assert {n.split("/")[0] for n in names} == {*PACKAGES, info}  # no tests, testing, bench, infra
    assert {f"{p}/__init__.py" for p in PACKAGES} <= set(names)
    # The package data the code reads at run time.
    assert any(re.fullmatch(r"renderfleet/lua/\w+\.lua", n) for n in names)
    assert any(re.fullmatch(r"dispatcher/views/templates/\w+\.html", n) for n in names)
    assert any(n.startswith("dispatcher/views/static/") for n in names)
    entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "renderfleet = renderfleet.cli:main" in entry


def test_the_wheel_carries_the_licence_its_metadata_names(wheel: Path) -> None:
    z = zipfile.ZipFile(wheel)
    (info,) = {n.split("/")[0] for n in z.namelist() if ".dist-info/" in n}
    metadata = z.read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    licence = z.read(f"{info}/licenses/LICENSE").decode()
    assert licence == (REPO / "LICENSE").read_text() and "Apache License" in licence and "Version 2.0" in licence


def test_the_import_names_resolve_to_the_wheels_files(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import renderfleet.cli, dispatcher.fleet.autoscale, "
        "dispatcher.fleet.backends, worker.node.protection; print(json.dumps([m.__file__ for m in (renderfleet.cli, "
        "dispatcher.fleet.autoscale, dispatcher.fleet.backends, worker.node.protection)]))"
    )
    # -I: not this checkout's folders (the working directory, PYTHONPATH); the venv's dependencies only.
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tmp_path / "site")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=tmp_path,
    ).stdout
    assert all(Path(f).is_relative_to(tmp_path / "site") for f in json.loads(out))


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(line.split()[0].upper(), line) for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.worker", "Dockerfile.dispatcher"])
def test_each_image_installs_its_dependencies_before_copying_the_source(dockerfile: str) -> None:
    steps = _instructions(DOCKER / dockerfile)
    first, second = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    build = steps[first:second]  # the build stage
    copies = [i for i, (op, line) in enumerate(build) if op == "COPY"]
    deps = next(i for i, (op, line) in enumerate(build) if op == "RUN" and "-r /tmp/requirements.txt" in line)
    source = [i for i in copies if any(f" {p} " in build[i][1] + " " for p in PACKAGES)]
    assert source and deps < min(source)  # a code change reuses the dependency layer
    assert [line for op, line in build[:deps] if op == "COPY"] == ["COPY pyproject.toml constraints.txt ./"]
    assert "pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt" in build[deps][1]  # reproducible
    install = next(line for op, line in build if op == "RUN" and "pip install" in line and line.rstrip().endswith(" ."))
    assert "--no-deps" in install


@pytest.mark.parametrize("dockerfile", ["Dockerfile.worker", "Dockerfile.dispatcher"])
def test_each_base_image_is_pinned_by_digest(dockerfile: str) -> None:
    steps = _instructions(DOCKER / dockerfile)
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", (DOCKER / dockerfile).read_text(), re.MULTILINE))
    froms = [line.split()[1] for op, line in steps if op == "FROM"]
    assert len(froms) == 2
    for image in froms:
        image = args.get(image.strip("${}"), image)
        assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", image), image


def test_the_dispatcher_image_has_a_health_check_on_the_port_its_command_serves() -> None:
    steps = dict(_instructions(DOCKER / "Dockerfile.dispatcher"))
    assert "HEALTHCHECK" in steps and "127.0.0.1:9464" in steps["HEALTHCHECK"]
    cmd = json.loads(steps["CMD"].removeprefix("CMD "))
    assert cmd[:3] == ["monitor", "--http", "127.0.0.1:9464"]
    assert "HEALTHCHECK" not in dict(_instructions(DOCKER / "Dockerfile.worker"))  # no HTTP port by default


def test_the_root_dockerignore_admits_exactly_what_the_images_copy() -> None:
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*"  # an allow-list: nothing reaches a build unless named
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for dockerfile in ("Dockerfile.worker", "Dockerfile.dispatcher"):
        for op, line in _instructions(DOCKER / dockerfile):
            if op == "COPY" and "--from" not in line:
                copied |= {p.rstrip("*/").removeprefix("./") for p in line.split()[1:-1]}
    assert copied <= allowed and {"LICENSE", *PACKAGES} <= copied


def test_the_compose_baseline_reserves_one_gpu_and_the_spot_node_its_listed_gpus_under_one_supervisor() -> None:
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    workers = {name: s for name, s in services.items() if s.get("image") == "renderfleet-worker"}
    assert len(workers) == 2
    base, spot = workers["worker-baseline"], workers["worker-spot"]
    assert base["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    # the spot service is a node: a device list, one worker per device under `worker --gpus all`
    [devices] = spot["deploy"]["resources"]["reservations"]["devices"]
    assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"] and devices["device_ids"]
    assert "count" not in devices and spot["command"][-2:] == ["--gpus", "all"]
