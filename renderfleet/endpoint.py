"""An HTTP endpoint of the fleet: on loopback by default, off it only behind RENDERFLEET_HTTP_TOKEN.

The monitor's page and ``/metrics`` (``dispatcher/http.py``) and each
worker's own ``/metrics`` (``worker/metrics.py``) follow one rule, kept here
once: :func:`listen` refuses an address off loopback unless a token is set,
and :func:`guard` puts every request behind the token whenever one is set
(``Authorization: Bearer TOKEN``, ``?token=TOKEN``, or the HttpOnly cookie a
page opened once with ``?token=`` sets).  :class:`Endpoint` serves an ASGI
app with uvicorn in a daemon thread, on a socket bound before it starts (so
a port taken or refused is a :class:`ConfigError` at start-up, not a log
line in a thread).

Nothing happens at import; starlette and uvicorn are imported on first use.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from renderfleet.errors import ConfigError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "renderfleet_token"


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listen(host: str, port: int, token: str | None, *, what: str) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one).

    Off loopback it needs ``token`` (RENDERFLEET_HTTP_TOKEN); ``what`` names
    the flag or setting in the error (``--http 0.0.0.0:9464``).
    """
    host = host.strip("[]") or "127.0.0.1"
    if not loopback(host) and not token:
        raise ConfigError(f"{what}: off loopback the endpoint needs RENDERFLEET_HTTP_TOKEN set")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{what}: cannot listen there: {exc}") from exc
    sock.listen(128)
    return sock


class TokenGate:
    """Every request needs the token: ``Authorization: Bearer``, the cookie, or ``?token=``.

    A page opened with a good ``?token=`` sets an HttpOnly cookie and redirects
    to the same URL without it, so the token leaves the address bar and history.
    """

    def __init__(self, app: ASGIApp, token: str):
        self.app, self.token = app, token.encode()

    def good(self, given: str) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.requests import Request
        from starlette.responses import PlainTextResponse, RedirectResponse, Response

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        header = request.headers.get("authorization", "")
        bearer = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        query = request.query_params.get("token", "")
        response: Response | None = None
        if self.good(query) and request.method == "GET" and not scope["path"].startswith(("/api/", "/metrics")):
            rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
            response = RedirectResponse(scope["path"] + (f"?{rest}" if rest else ""), status_code=303)
            response.set_cookie(COOKIE, query, httponly=True, samesite="strict", path="/",
                                secure=request.url.scheme == "https")
        elif not (self.good(bearer) or self.good(query) or self.good(request.cookies.get(COOKIE, ""))):
            response = PlainTextResponse("a token is required: Authorization: Bearer RENDERFLEET_HTTP_TOKEN, "
                                         "or open the page once with ?token=\n", status_code=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        if response is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def guard(app: ASGIApp, token: str | None) -> ASGIApp:
    """``app`` behind the token when one is set (on loopback too), else as it is."""
    return TokenGate(app, token) if token is not None else app


class Endpoint:
    """A running endpoint: uvicorn in a daemon thread, on a socket bound before it starts."""

    def __init__(self, app: ASGIApp, sock: socket.socket, *, name: str = "rf-http",
                 on_shutdown: Callable[[], None] | None = None):
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server: Any = uvicorn.Server(config)
        self.sock = sock
        self.on_shutdown = on_shutdown
        self.server_port: int = sock.getsockname()[1]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)

    def start(self) -> Endpoint:
        self.thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving and wait for the thread (a few seconds at most)."""
        if self.on_shutdown is not None:
            self.on_shutdown()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
