"""The endpoint rule shared by the monitor and the workers: loopback by default, the token off it and wherever set.

A real uvicorn in a thread on a loopback port, spoken to with http.client (redirects are not followed).
"""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from renderfleet.endpoint import COOKIE, Endpoint, guard, listen, loopback
from renderfleet.errors import ConfigError


def hello(_: object) -> PlainTextResponse:
    return PlainTextResponse("hello")


@pytest.fixture
def gated() -> Iterator[int]:
    app = Starlette(routes=[Route("/", hello), Route("/metrics", hello)])
    endpoint = Endpoint(guard(app, "s3cret"), listen("127.0.0.1", 0, "s3cret", what="test")).start()
    yield endpoint.server_port
    endpoint.shutdown()


def request(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


@pytest.mark.parametrize(("host", "inside"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                              ("0.0.0.0", False), ("10.0.0.5", False), ("example.org", False)])
def test_only_loopback_addresses_count_as_loopback(host: str, inside: bool) -> None:
    assert loopback(host) is inside


def test_off_loopback_nothing_listens_without_a_token() -> None:
    with pytest.raises(ConfigError, match=r"--http 0\.0\.0\.0:1: off loopback .*RENDERFLEET_HTTP_TOKEN"):
        listen("0.0.0.0", 0, None, what="--http 0.0.0.0:1")
    with pytest.raises(ConfigError, match="cannot listen there"):
        listen("192.0.2.1", 0, "tok", what="--http 192.0.2.1:0")  # TEST-NET: not an address of this machine


def test_a_page_opened_with_the_token_sets_an_httponly_cookie_and_drops_the_token_from_the_address(
    gated: int,
) -> None:
    assert request(gated, "/").status == 401
    resp = request(gated, "/?token=s3cret&page=2")
    assert resp.status == 303 and resp.getheader("Location") == "/?page=2"
    cookie = resp.getheader("Set-Cookie") or ""
    assert cookie.startswith(f"{COOKIE}=s3cret") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert request(gated, "/", {"Cookie": f"{COOKIE}=s3cret"}).status == 200
    assert request(gated, "/", {"Cookie": f"{COOKIE}=wrong"}).status == 401


def test_a_scraper_uses_the_bearer_header_or_the_query_and_is_never_redirected(gated: int) -> None:
    assert request(gated, "/metrics").status == 401
    assert request(gated, "/metrics", {"Authorization": "Bearer wrong"}).status == 401
    assert request(gated, "/metrics", {"Authorization": "Bearer s3cret"}).status == 200
    assert request(gated, "/metrics?token=s3cret").status == 200
