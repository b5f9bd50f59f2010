"""The test run's guard against connections beyond loopback (testing/netguard, issue 47 item 4)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testing import netguard


@pytest.mark.parametrize(
    "address", [("127.0.0.1", 6379), ("::1", 80, 0, 0), ("::ffff:127.0.0.1", 80, 0, 0), ("localhost", 80), ("0.0.0.0", 1)]
)
def test_loopback_is_allowed(address: tuple[object, ...]) -> None:
    assert netguard.problem(address) is None


@pytest.mark.parametrize(
    "address", [("169.254.169.254", 80), ("10.1.2.3", 443), ("fd00:ec2::254", 80, 0, 0), ("8.8.8.8", 53)]
)
def test_anything_else_is_refused_naming_the_address(address: tuple[object, ...]) -> None:
    assert netguard.problem(address) == f"connection to {address[0]}:{address[1]} refused: beyond loopback"


def test_a_unix_socket_is_none_of_its_business() -> None:
    assert netguard.problem("/tmp/redis.sock") is None and netguard.problem(b"\0abstract") is None


def test_this_process_is_guarded_and_so_is_every_process_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Logged to a file of this test's own: the session's log would fail it (tests/conftest.py).
    own_log = tmp_path / "guard.log"
    monkeypatch.setenv(netguard.LOG_VARIABLE, str(own_log))
    # In this process (installed by tests/conftest.py): an OSError, as a network that is down gives.
    with socket.socket() as sock, pytest.raises(netguard.BeyondLoopback, match=r"10\.255\.255\.1:9 "):
        sock.connect(("10.255.255.1", 9))
    assert f"pid {os.getpid()} " in own_log.read_text() and "10.255.255.1:9 refused" in own_log.read_text()
    # A child (a worker, the CLI) inherits it through sitecustomize, and its attempt is logged with its stack.
    code = (
        "import socket\ntry:\n    socket.create_connection(('169.254.169.254', 80), timeout=1)\n"
        "except OSError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "connection to 169.254.169.254:80 refused: beyond loopback"
    assert "169.254.169.254:80 refused" in own_log.read_text() and "create_connection" in own_log.read_text()
