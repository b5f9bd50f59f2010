"""The endpoint rule shared by the monitor and the workers: loopback by default, the token off it and wherever set;
without a token, only a loopback Host; security headers on every answer.

A real uvicorn in a thread on a loopback port, spoken to with http.client (redirects are not followed).
"""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from renderfleet.endpoint import (
    COOKIE,
    SECURITY_HEADERS,
    Endpoint,
    client_key,
    guard,
    host_allowed,
    listen,
    loopback,
    same_site,
)
from renderfleet.errors import ConfigError
from renderfleet.settings import load_settings


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
    conn.request("GET", path, headers=headers or {})  # Host: 127.0.0.1:PORT unless given
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


@pytest.mark.parametrize(
    ("host", "inside"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("example.org", False),
        # IPv4-mapped IPv6 (::ffff:0:0/96) is its IPv4 address, in either notation
        ("::ffff:127.0.0.1", True),
        ("::ffff:7f00:1", True),
        ("0:0:0:0:0:ffff:7f00:1", True),
        ("::ffff:10.0.0.5", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(host: str, inside: bool) -> None:
    assert loopback(host) is inside


def test_a_client_is_one_address_whatever_form_a_dual_stack_socket_shows_it_in() -> None:
    assert client_key("::ffff:10.0.0.7") == client_key("::ffff:a00:7") == client_key("10.0.0.7") == "10.0.0.7"
    assert client_key("2001:DB8::1") == client_key("2001:db8:0::1") and client_key("Proxy.lan") == "proxy.lan"
    assert host_allowed("[::ffff:127.0.0.1]:9464", ("127.0.0.1", 9464))
    assert not host_allowed("[::ffff:a00:5]:9464", ("127.0.0.1", 9464))


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


# ---- hostile requests: Host, redirects, the cookie, headers; the token's strength ----


@pytest.fixture
def open_port() -> Iterator[int]:
    """No token (loopback): the Host check, with one more name allowed."""
    app = Starlette(routes=[Route("/", hello)])
    endpoint = Endpoint(
        guard(app, None, hosts=("monitor.lan", "proxy.lan:8443")), listen("127.0.0.1", 0, None, what="test")
    ).start()
    yield endpoint.server_port
    endpoint.shutdown()


@pytest.fixture
def behind_tls() -> Iterator[int]:
    app = Starlette(routes=[Route("/", hello)])
    endpoint = Endpoint(guard(app, "s3cret", tls_proxy=True), listen("127.0.0.1", 0, "s3cret", what="test")).start()
    yield endpoint.server_port
    endpoint.shutdown()


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:9464", True),
        ("localhost:9464", True),
        ("[::1]:9464", True),
        ("LocalHost:9464", True),
        ("monitor.lan", True),
        ("monitor.lan:1234", True),
        ("proxy.lan:8443", True),
        ("127.0.0.1", False),
        ("localhost:9465", False),
        ("evil.example:9464", False),
        ("evil.example", False),
        ("proxy.lan", False),
        ("proxy.lan:80", False),
        ("monitor.lan.evil.example", False),
        ("", False),
        ("127.0.0.1:9464@evil.example", False),
        ("[::1]", False),
    ],
)
def test_without_a_token_only_loopback_names_with_the_port_or_the_hosts_allowed_are_answered(
    host: str, allowed: bool
) -> None:
    assert host_allowed(host, ("127.0.0.1", 9464), ("monitor.lan", "proxy.lan:8443")) is allowed


def test_the_bound_address_is_a_loopback_name_too_and_port_80_may_go_unsaid() -> None:
    assert host_allowed("127.0.0.2:9000", ("127.0.0.2", 9000)) and host_allowed("[::1]:9000", ("::1", 9000))
    assert host_allowed("localhost", ("127.0.0.1", 80)) and not host_allowed("localhost", ("127.0.0.1", 81))


def test_a_tokenless_endpoint_refuses_another_host_with_the_security_headers_on_every_answer(open_port: int) -> None:
    ok = request(open_port, "/")
    assert ok.status == 200
    for host in ("evil.example", f"evil.example:{open_port}"):
        assert request(open_port, "/", {"Host": host}).status == 400
    assert request(open_port, "/", {"Host": "monitor.lan"}).status == 200
    for resp in (ok, request(open_port, "/", {"Host": "evil.example"})):
        assert resp.getheader("Content-Security-Policy") == SECURITY_HEADERS["content-security-policy"]
        assert resp.getheader("X-Content-Type-Options") == "nosniff" and resp.getheader("X-Frame-Options") == "DENY"
        assert resp.getheader("Referrer-Policy") == "no-referrer"


@pytest.mark.parametrize(
    ("path", "location"),
    [
        ("//evil.example/?token=s3cret", "/evil.example/"),
        ("/\\evil.example?token=s3cret", "/evil.example"),
        ("/%2F%2Fevil.example?token=s3cret", "/evil.example"),
        ("////x?token=s3cret&a=1", "/x?a=1"),
        ("/jobs/j-1?page=3&token=s3cret", "/jobs/j-1?page=3"),
    ],
)
def test_the_login_redirect_never_leaves_the_site(gated: int, path: str, location: str) -> None:
    resp = request(gated, path)
    assert resp.status == 303 and resp.getheader("Location") == location
    assert same_site("//a") == same_site("/\\a") == same_site("/a") == "/a"


def test_the_cookie_is_secure_over_https_and_a_proxys_word_counts_only_when_trusted(gated: int, behind_tls: int) -> None:
    https = {"X-Forwarded-Proto": "https"}
    assert "Secure" not in (request(gated, "/?token=s3cret", https).getheader("Set-Cookie") or "")
    assert "Secure" not in (request(behind_tls, "/?token=s3cret").getheader("Set-Cookie") or "")
    assert "Secure" in (request(behind_tls, "/?token=s3cret", https).getheader("Set-Cookie") or "")
    assert "Secure" in (
        request(behind_tls, "/?token=s3cret", {"X-Forwarded-Proto": "https, http"}).getheader("Set-Cookie") or ""
    )


@pytest.mark.parametrize(
    "token", ["x", " ", "a" * 15, "a" * 15 + " ", "sixteen chars ok", "a" * 16 + "\n", "a" * 16 + "\x00"]
)
def test_a_weak_token_is_refused_naming_the_setting_never_showing_it(token: str) -> None:
    with pytest.raises(ConfigError, match="RENDERFLEET_HTTP_TOKEN: must be at least 16 characters") as err:
        load_settings(http_token=token)
    assert token.strip() not in str(err.value) or len(token.strip()) < 2


def test_a_strong_token_is_taken_and_an_empty_one_is_none() -> None:
    assert load_settings(http_token="0123456789abcdef").http_token == "0123456789abcdef"
    assert load_settings(http_token="").http_token is None


def test_the_hosts_allowed_are_names_with_an_optional_port() -> None:
    assert load_settings(http_hosts=" Monitor.lan, proxy.lan:8443 ").http_host_list == ("monitor.lan", "proxy.lan:8443")
    for bad in ("http://monitor.lan", "monitor.lan/x", "a b", "monitor.lan:port"):
        with pytest.raises(ConfigError, match="RENDERFLEET_HTTP_HOSTS"):
            load_settings(http_hosts=bad)
