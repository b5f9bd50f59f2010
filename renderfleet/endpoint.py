"""An HTTP endpoint of the fleet: on loopback by default, off it only behind RENDERFLEET_HTTP_TOKEN.

The monitor's page and ``/metrics`` (``dispatcher/views/http.py``) and each
worker's own ``/metrics`` (``worker/accounting/metrics.py``) follow one rule, kept here
once: :func:`listen` refuses an address off loopback unless a token is set,
and :func:`guard` puts every request behind the token whenever one is set
(``Authorization: Bearer TOKEN``, ``?token=TOKEN``, or the HttpOnly cookie a
page opened once with ``?token=`` sets).  Without a token (on loopback only)
it answers only requests whose ``Host`` names this machine's loopback, or a
host the settings allow (``RENDERFLEET_HTTP_HOSTS``): a page elsewhere that
rebinds its DNS name to 127.0.0.1 reads nothing.  Every answer carries the
security headers (:data:`SECURITY_HEADERS`).  :class:`Endpoint` serves an ASGI
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
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "renderfleet_token"

# The page loads its own script, stylesheet, images and JSON and nothing else;
# no inline script or style (the progress bars' widths are set by the script),
# no frames around it, no referrer sent with a link out of it.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}
# An image opened on its own: the browser's image viewer styles it inline; no script, no frames.
IMAGE_CSP = "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; frame-ancestors 'none'; sandbox"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an address (brackets and an IPv6 zone index left out), an IPv4-mapped IPv6 one
    (``::ffff:127.0.0.1``, ``::ffff:7f00:1``: how a dual-stack socket shows an IPv4 peer) as its IPv4
    address; None for a name."""
    try:
        address = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_key(host: str) -> str:
    """One client's address as one text whatever form it came in (an IPv4 peer of a dual-stack socket as
    its IPv4 address): what a per-client limit counts by."""
    address = ip_of(host)
    return host.lower() if address is None else str(address)


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    address = ip_of(host)
    return host == "localhost" if address is None else address.is_loopback


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
    The cookie is ``Secure`` when the request came over https: uvicorn's TLS
    (never here), or, with ``tls_proxy`` (``RENDERFLEET_HTTP_TLS_PROXY``), a
    reverse proxy's ``X-Forwarded-Proto: https``.
    """

    def __init__(self, app: ASGIApp, token: str, *, tls_proxy: bool = False):
        self.app, self.token, self.tls_proxy = app, token.encode(), tls_proxy

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
        bearer = header[len("Bearer ") :].strip() if header.startswith("Bearer ") else ""
        query = request.query_params.get("token", "")
        response: Response | None = None
        if self.good(query) and request.method == "GET" and not scope["path"].startswith(("/api/", "/metrics")):
            rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
            response = RedirectResponse(same_site(scope["path"]) + (f"?{rest}" if rest else ""), status_code=303)
            response.set_cookie(
                COOKIE,
                query,
                httponly=True,
                samesite="strict",
                path="/",
                secure=self.https(request.url.scheme, request.headers.get("x-forwarded-proto", "")),
            )
        elif not (self.good(bearer) or self.good(query) or self.good(request.cookies.get(COOKIE, ""))):
            response = PlainTextResponse(
                "a token is required: Authorization: Bearer RENDERFLEET_HTTP_TOKEN, or open the page once with ?token=\n",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if response is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def https(self, scheme: str, forwarded_proto: str) -> bool:
        """Whether the browser reached us over https: our own scheme, or the trusted proxy's word."""
        # A proxy chain appends: the first value is what the browser used.
        return scheme == "https" or (self.tls_proxy and forwarded_proto.split(",")[0].strip().lower() == "https")


def same_site(path: str) -> str:
    """``path`` as a path of this site: one leading ``/``, never ``//host`` or ``/\\host`` (read as another site)."""
    return "/" + path.lstrip("/\\")


def host_allowed(host: str, server: tuple[str, int] | None, extra: tuple[str, ...] = ()) -> bool:
    """Whether a request's ``Host`` names this endpoint: a loopback name (or the bound
    address) with the port it listens on, or an entry of ``extra`` (``name`` for any
    port, ``name:port`` for that one)."""
    host = host.strip().lower()
    if host.endswith("]") or ":" not in host:  # no port given: port 80
        name, port = host, "80"
    else:
        name, _, port = host.rpartition(":")
    if server is not None:
        bound = f"[{server[0]}]" if ":" in server[0] else server[0]
        literal = ip_of(name) if name.startswith("[") else None  # [::ffff:127.0.0.1] is 127.0.0.1
        if (name in (*LOOPBACK_NAMES, bound) or (literal is not None and literal.is_loopback)) and port == str(server[1]):
            return True
    return host in extra or name in extra


class HostCheck:
    """Without a token: only requests for a ``Host`` of :func:`host_allowed` (DNS rebinding reads nothing)."""

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...] = ()):
        self.app, self.hosts = app, tuple(h.lower() for h in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.datastructures import Headers
        from starlette.responses import PlainTextResponse

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "")
        if not host_allowed(host, scope.get("server"), self.hosts):
            response = PlainTextResponse(
                "this endpoint answers only for localhost, 127.0.0.1 or [::1] with its port, "
                "and the hosts named in RENDERFLEET_HTTP_HOSTS\n",
                status_code=400,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every answer (the gates' refusals included) that does not set its own."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.datastructures import MutableHeaders

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, with_headers)


def guard(app: ASGIApp, token: str | None, *, hosts: tuple[str, ...] = (), tls_proxy: bool = False) -> ASGIApp:
    """``app`` behind the token when one is set (on loopback too), else behind the
    ``Host`` check (``hosts``: the names allowed beside loopback's); the security
    headers on every answer."""
    inner = TokenGate(app, token, tls_proxy=tls_proxy) if token is not None else HostCheck(app, hosts)
    return SecurityHeaders(inner)


class Endpoint:
    """A running endpoint: uvicorn in a daemon thread, on a socket bound before it starts."""

    def __init__(
        self, app: ASGIApp, sock: socket.socket, *, name: str = "rf-http", on_shutdown: Callable[[], None] | None = None
    ):
        import uvicorn

        # proxy_headers off: uvicorn would otherwise take X-Forwarded-Proto from any
        # client on 127.0.0.1; which proxy is trusted is TokenGate's rule, one setting.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", proxy_headers=False)
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
