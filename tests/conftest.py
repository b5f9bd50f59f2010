"""Shared fixtures: real servers, started once per session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from renderfleet.embedded import RedisServerProcess
from testing import cliforks, netguard
from testing.fleet import WorkerProc, start_redis
from testing.servers import MotoServer, s3_env


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--spawn-cli",
        action="store_true",
        help="run each test's renderfleet command in a new interpreter, not forked from one that imported "
        "the CLI once (testing/cliforks.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """No test connects beyond loopback (testing/netguard): the guard in this process, and through
    ``sitecustomize`` on ``PYTHONPATH`` in every process a test starts; each process's attempts go to
    one log per test process, read after each test by :func:`_no_connection_beyond_loopback`."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    log = Path(tempfile.gettempdir()) / f"renderfleet-netguard-{os.getpid()}-{worker}.log"
    log.unlink(missing_ok=True)
    os.environ[netguard.LOG_VARIABLE] = str(log)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (netguard.SITE, os.environ.get("PYTHONPATH")) if p)
    netguard.install()
    cliforks.spawn = config.getoption("--spawn-cli")


@pytest.fixture(autouse=True)
def _no_connection_beyond_loopback() -> Iterator[None]:
    """Fail the test in which any of the run's processes tried to connect beyond loopback, naming where."""
    log = Path(os.environ[netguard.LOG_VARIABLE])
    seen = log.stat().st_size if log.exists() else 0
    yield
    if log.exists() and log.stat().st_size > seen:
        with open(log) as f:
            f.seek(seen)
            tried = f.read()
        pytest.fail(f"a connection beyond loopback was tried (testing/netguard):\n{tried[:4000]}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` or ``heavy`` (a minute or more of fleet work a file) run first:
    pytest-xdist hands out whole files (``--dist loadfile``) in this order, so a long file started
    last would keep one process busy while the others have finished."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("heavy")))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """moto's S3 in server mode on a free port, for the whole session."""
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty bucket on the moto server; the AWS env points at it.

    Returns the store URL ``s3://<bucket>/rf-test``.
    """
    bucket = f"rf-{uuid.uuid4().hex[:20]}"
    # These would win over (or add to) the test keys and endpoint below.
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_env(moto_server.endpoint_url, bucket).items():
        monkeypatch.setenv(name, value)
    client = boto3.session.Session().client("s3", endpoint_url=moto_server.endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/rf-test"


@pytest.fixture(params=["folder", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A test that takes it runs twice: on a folder store, and on a fresh S3 bucket on the moto server.

    For the tests whose outcome depends on the store (writes, listings, deletions); the rest
    use the folder store only, to keep the suite's time down.  A whole-fleet scenario (workers,
    a monitor, a restart: 10-30 s each) runs on one of the two, named by :data:`ON_S3` or
    :data:`ON_FOLDER`: the store's own behaviour is tested on both by test_store.py, and the
    scenarios are split between the two kinds.
    """
    if request.param == "folder":
        return str(tmp_path / "store")
    return str(request.getfixturevalue("s3_bucket"))


ON_S3 = pytest.mark.parametrize("store_url", ["s3"], indirect=True)
ON_FOLDER = pytest.mark.parametrize("store_url", ["folder"], indirect=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServerProcess]:
    """A private Redis server on a free port; tests may kill and restart it."""
    server = start_redis(tmp_path / "redis")
    yield server
    server.close()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes] | WorkerProc]]:
    """Processes a test starts (workers, monitors): killed, process group and all, at the end."""
    started: list[subprocess.Popen[bytes] | WorkerProc] = []
    yield started
    for p in started:
        if isinstance(p, WorkerProc):
            p.kill()
        elif p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reaches the Hugging Face hub (renderfleet/hubrev.py: submit asks it whether a hub id
    is a pipeline): offline, in this process and in those it starts; a test that needs an answer
    hands submit a stand-in (``Client(resolve_revision=..., check_hub_model=...)``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if (constants := sys.modules.get("huggingface_hub.constants")) is not None:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
