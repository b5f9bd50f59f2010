"""RENDERFLEET_REDIS_URL naming a Sentinel-managed Redis: one URL, parsed once, turned into
redis-py's Sentinel master client and kombu's sentinel:// broker; a bad one refused by name,
its password never shown (renderfleet/redisconn.py)."""

from __future__ import annotations

import pytest
from kombu.utils.url import url_to_parts
from redis.sentinel import SentinelConnectionPool

from renderfleet import redisconn
from renderfleet.celery_app import VISIBILITY_TIMEOUT, make_app
from renderfleet.errors import ConfigError
from renderfleet.redisconn import SentinelURL, broker, parse_sentinel
from renderfleet.settings import load_settings, redact, redis_url_problem
from testing.servers import free_port

URL = "redis+sentinel://:pw@s1:26380,s2,10.0.0.3:26381/mymaster/2"


def test_a_sentinel_url_names_every_sentinel_the_master_and_the_database() -> None:
    assert parse_sentinel(URL) == SentinelURL(
        sentinels=(("s1", 26380), ("s2", 26379), ("10.0.0.3", 26381)), master="mymaster", db=2, password="pw"
    )
    assert parse_sentinel("redis+sentinel://s1/m").db == 0  # no database: 0
    assert parse_sentinel("redis+sentinel://[::1]:5,s2/m").sentinels == (("::1", 5), ("s2", 26379))


def test_a_password_user_and_sentinel_password_are_percent_decoded() -> None:
    url = "redis+sentinel://Usr4:p%2Fw%40x%2C@s1/m?sentinel_password=q%26r"
    parsed = parse_sentinel(url)
    assert (parsed.username, parsed.password, parsed.sentinel_password) == ("Usr4", "p/w@x,", "q&r")
    # a ',' or '@' left unencoded in a password still reads as meant: the last '@' ends it
    assert parse_sentinel("redis+sentinel://:a,b@c@s1,s2/m").password == "a,b@c"


def test_tls_is_rediss_sentinel_and_verifies_the_server_by_default() -> None:
    parsed = parse_sentinel("rediss+sentinel://:pw@s1/m?ssl_ca_certs=/etc/ca.pem")
    assert parsed.tls and parsed.ssl_kwargs() == {"ssl": True, "ssl_cert_reqs": "required", "ssl_ca_certs": "/etc/ca.pem"}
    assert parse_sentinel(URL).ssl_kwargs() == {}


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://s1,s2", "names no master"),
        ("redis+sentinel://s1/", "names no master"),
        ("redis+sentinel://s1/m/x", "MASTER or MASTER/DB"),
        ("redis+sentinel://s1/m/0/1", "MASTER or MASTER/DB"),
        ("redis+sentinel://s1:port/m", "cannot be parsed"),
        ("redis+sentinel://s1:70000/m", "cannot be parsed"),
        ("redis+sentinel://s1,,s2/m", "empty sentinel host"),
        ("redis+sentinel://s1/m?db=1", "unknown option 'db'"),
        ("redis+sentinel://s1/m?ssl_ca_certs=/ca", "for rediss+sentinel:// only"),
        ("rediss+sentinel://s1/m?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("redis+sentinel://Xq7Zk9@s1/m", "names a user but no password"),
        ("redis+sentinel://s1:\u00b2/m", "cannot be parsed"),  # a digit to str.isdigit, not to int()
        ("redis+sentinel://s1/m/\u00b2", "MASTER or MASTER/DB"),
    ],
)
def test_a_bad_sentinel_url_is_refused_saying_why(url: str, why: str) -> None:
    problem = redis_url_problem(url)
    assert problem is not None and why in problem, problem


# Passwords a parser could misread as a host, a port, the master or an option: refused, unquoted.
HOSTILE = [
    "redis+sentinel://:Xq7/Zk9@s1,s2/m",
    "redis+sentinel://:Xq7?Zk9@s1/m",
    "redis+sentinel://:Xq7#Zk9@s1/m",
    "redis+sentinel://Usr4:Xq7/Zk9@s1:26379/m/0",
    "redis+sentinel://:Xq7\nZk9@s1/m",
    "redis+sentinel://Xq7Zk9@s1/m",  # a password written as the user name
    "redis+sentinel://:123/Xq7Zk9@s1:26379/m",  # read as port 123 by a naive parser
]


@pytest.mark.parametrize("url", HOSTILE)
def test_a_hostile_sentinel_url_is_refused_by_name_in_one_line_without_its_secret(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(redis_url=url)
    text = str(err.value)
    assert text.startswith("RENDERFLEET_REDIS_URL: ") and "\n" not in text, text
    assert "Xq7" not in text and "Zk9" not in text and "Usr4" not in text, text


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://:Xq7Zk9@s1:26379,s2:26379/mymaster/0",
        "redis+sentinel://Usr4:Xq7Zk9@s1/m?sentinel_password=Xq7Zk9",
        "rediss+sentinel://:Xq7%2FZk9@s1/m?ssl_cert_reqs=required",
    ],
)
def test_redaction_of_a_sentinel_url_hides_both_passwords_and_keeps_the_sentinels(url: str) -> None:
    assert load_settings(redis_url=url).redis_url == url  # accepted as it is
    out = redact(url)
    assert "Xq7" not in out and "Zk9" not in out and "Usr4" not in out and "s1" in out, out


def test_the_broker_is_kombus_sentinel_transport_with_the_password_on_every_sentinel() -> None:
    url, options, use_ssl = broker("redis+sentinel://:p%2Fw@s1:26380,s2/mymaster/2?sentinel_password=sp")
    assert url == "sentinel://:p%2Fw@s1:26380/2;sentinel://:p%2Fw@s2:26379/2"
    assert [url_to_parts(u).password for u in url.split(";")] == ["p/w", "p/w"]  # kombu reads it back
    assert options["master_name"] == "mymaster" and options["sentinel_kwargs"]["password"] == "sp"
    assert use_ssl is None
    assert broker("redis://:pw@h:6379/0") == ("redis://:pw@h:6379/0", {}, None)  # a plain URL: as it is


def test_tls_reaches_kombu_as_broker_use_ssl_and_the_sentinels_options() -> None:
    _, options, use_ssl = broker("rediss+sentinel://:pw@s1/m?ssl_ca_certs=/ca.pem")
    assert use_ssl == {"ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem"}
    assert options["sentinel_kwargs"]["ssl"] is True and options["sentinel_kwargs"]["ssl_ca_certs"] == "/ca.pem"


def test_the_celery_app_of_a_sentinel_url_keeps_our_transport_options_and_hides_the_password() -> None:
    app = make_app(URL)
    conf = app.conf.broker_transport_options
    assert conf["master_name"] == "mymaster" and conf["visibility_timeout"] == VISIBILITY_TIMEOUT
    with app.connection_for_write() as conn:  # builds the connection; connects to nothing
        assert conn.transport_cls == "sentinel" and len(conn.alt) == 3
        assert "pw" not in conn.as_uri()


def test_the_client_of_a_sentinel_url_is_the_masters_and_connects_to_nothing_yet() -> None:
    client = redisconn.client(
        "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/mymaster/3?sentinel_password=sp", socket_timeout=7
    )
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster" and pool.is_master
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (3, "pw")
    assert pool.connection_kwargs["socket_timeout"] == 7
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert all(s.connection_pool.connection_kwargs["password"] == "sp" for s in sentinels)


def test_the_client_of_a_plain_url_is_redis_pys_own() -> None:
    # a port nothing listens on (not the machine's shared 6379), should anything ever connect
    client = redisconn.client(f"redis://:pw@127.0.0.1:{free_port()}/4", socket_timeout=3)
    assert client.connection_pool.connection_kwargs["db"] == 4
    assert not isinstance(client.connection_pool, SentinelConnectionPool)
