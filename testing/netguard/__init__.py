"""No test or bench connects beyond loopback (issue 47): a guard on every socket of the test run.

A worker of a pool named ``*spot*`` watches the clouds' metadata services by default, a webhook names any
host, an S3 store any endpoint: a test that forgot to point one at its local stand-in (testing/metadata.py,
the moto server) would reach out from a developer's laptop or a CI runner.  :func:`install` wraps
``socket.connect`` and ``connect_ex``: a connection to an address that is not loopback (nor a Unix socket)
fails at once with :class:`BeyondLoopback`, an ``OSError`` as a network that is down would give, so the
code under test behaves as it would; and the attempt is appended to the file named by :data:`LOG_VARIABLE`,
which the test session's fixture (tests/conftest.py) reads after each test and fails that test with the
address.  The processes a test starts (workers, monitors, the CLI) inherit the guard through
``sitecustomize`` (this folder's ``site/``, put on ``PYTHONPATH`` by the session), so it holds in them too.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import traceback
from typing import Any

LOG_VARIABLE = "RENDERFLEET_NETGUARD_LOG"
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")

_installed = False


class BeyondLoopback(ConnectionRefusedError):
    """A test process tried to connect beyond loopback."""


def _loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        try:  # a name: every address it resolves to must be local
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return True  # resolves to nothing: nothing is reached
        return all(_loopback(str(info[4][0])) for info in infos)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def problem(address: Any) -> str | None:
    """Why connecting to ``address`` (a socket address) is refused, or None."""
    if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
        return None  # a Unix socket's path, or bytes of one
    if _loopback(address[0]):
        return None
    return f"connection to {address[0]}:{address[1] if len(address) > 1 else '?'} refused: beyond loopback"


def _record(why: str) -> None:
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        return
    where = "".join(traceback.format_stack(limit=8)[:-2])
    line = f"pid {os.getpid()} ({' '.join(sys.argv)[:200]}): {why}\n{where}".replace("\n", "\n    ")
    try:
        with open(path, "a") as log:
            log.write(line.rstrip() + "\n")
    except OSError:
        pass


def install() -> None:
    """Wrap ``socket.socket.connect`` and ``connect_ex`` in this process (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded_connect(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and (why := problem(address)):
            _record(why)
            raise BeyondLoopback(why)
        connect(self, address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> int:
        if self.family in (socket.AF_INET, socket.AF_INET6) and (why := problem(address)):
            _record(why)
            raise BeyondLoopback(why)
        return connect_ex(self, address)

    socket.socket.connect = guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded_connect_ex  # type: ignore[method-assign]
