"""A Redis URL in a message or a log line never shows a user name or password,
however the URL is written, and one that cannot be parsed as meant is refused
by name (RENDERFLEET_REDIS_URL) without quoting its secret."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from renderfleet.embedded import connect, free_port
from renderfleet.errors import BrokerUnavailable, ConfigError
from renderfleet.settings import load_settings, redact, redis_url_problem

# (url, the secrets in it: none may show, the part that should still show or None).
HOSTILE = [
    ("redis://:Xq7/Zk9@rhost:6379/0", ["Xq7", "Zk9"], "rhost:6379"),  # unencoded / in the password
    ("redis://:Xq7#Zk9@rhost:6379/0", ["Xq7", "Zk9"], "rhost:6379"),  # unencoded #
    ("redis://:Xq7?Zk9@rhost:6379/0", ["Xq7", "Zk9"], "rhost:6379"),  # unencoded ?
    ("redis://:Xq7@Zk9@rhost:6379/0", ["Xq7", "Zk9"], "rhost:6379"),  # unencoded @
    ("redis://:Xq7:Zk9@rhost:6379/0", ["Xq7", "Zk9"], "rhost:6379"),  # a colon
    ("redis://Xq7Zk9@rhost:6379/0", ["Xq7Zk9"], "rhost:6379"),  # a password written as the user name
    ("redis://Usr4:Xq7/Zk9@rhost/0", ["Usr4", "Xq7", "Zk9"], "rhost"),  # a user and a mangled password
    ("redis://Usr4:Xq7Zk9@rhost:6379/0", ["Usr4", "Xq7Zk9"], "rhost:6379"),  # an ACL user
    ("redis://:123/Xq7Zk9@rhost:6379/0", ["123/", "Xq7Zk9"], "rhost:6379"),  # read as port 123
    ("redis://Usr4:123?Xq7Zk9@rhost:1/0", ["Usr4", "Xq7Zk9"], "rhost:1"),  # host Usr4, port 123
    ("redis://Usr4:123#Xq7Zk9@rhost:1/0", ["Usr4", "Xq7Zk9"], "rhost:1"),
    ("redis://:Xq7Zk9@[::1]:6379/0", ["Xq7Zk9"], "[::1]:6379"),  # IPv6
    ("redis://:Xq7/Zk9@[::1]:6379/0", ["Xq7", "Zk9"], "[::1]:6379"),
    ("rediss://Usr4:Xq7Zk9@rhost:6380/0?ssl_cert_reqs=required", ["Usr4", "Xq7Zk9"], "rhost:6380"),
    ("rediss://:Xq7/Zk9@rhost:6380/0?ssl_cert_reqs=required", ["Xq7", "Zk9"], "rhost:6380"),
    ("unix://:Xq7Zk9@/run/redis.sock?db=0", ["Xq7Zk9"], "/run/redis.sock"),  # unix socket
    ("unix://:Xq7/Zk9@/run/redis.sock?db=0", ["Xq7", "Zk9"], "/run/redis.sock"),
    ("unix:///run/redis.sock?db=0&password=Xq7Zk9", ["Xq7Zk9"], "/run/redis.sock"),  # redis-py's ?password=
    ("redis://rhost:6379/0?username=Usr4&password=Xq7Zk9", ["Usr4", "Xq7Zk9"], "rhost:6379"),
    ("redis://:Xq7\nZk9@rhost:6379/0", ["Xq7", "Zk9", "\n"], "rhost:6379"),  # a line break
    ("redis://:Xq7\u202eZk9@rhost/0", ["Xq7", "Zk9", "\u202e"], "rhost"),
    ("http://Usr4:Xq7Zk9@rhost/0", ["Usr4", "Xq7Zk9"], "rhost"),  # not Redis at all
    ("Usr4:Xq7Zk9@rhost:6379", ["Usr4", "Xq7Zk9"], "rhost:6379"),  # no scheme
    ("redis://:Xq7Zk9@", ["Xq7Zk9"], None),
    ("redis://:Xq7[Zk9@rhost/0", ["Xq7", "Zk9"], "rhost"),  # urllib: "Invalid IPv6 URL"
]


@pytest.mark.parametrize(("url", "secrets", "shown"), HOSTILE)
def test_redaction_never_shows_a_user_or_password_and_keeps_the_host(
    url: str, secrets: list[str], shown: str | None
) -> None:
    out = redact(url)
    assert not [s for s in secrets if s in out], out
    assert "***" in out and out.isprintable()
    if shown is not None:
        assert shown in out, out


@pytest.mark.parametrize(("url", "secrets", "shown"), HOSTILE)
def test_a_hostile_redis_url_is_accepted_or_refused_by_name_in_one_line_without_its_secret(
    url: str, secrets: list[str], shown: str | None
) -> None:
    try:
        settings = load_settings(redis_url=url)
    except ConfigError as exc:
        text = str(exc)
        assert text.startswith("RENDERFLEET_REDIS_URL: ") and "\n" not in text, text
        assert not [s for s in secrets if s in text], text
        return
    # Accepted: only URLs that parse as meant, and every form of them we print is clean.
    assert redis_url_problem(url) is None
    assert settings.redis_url is not None and not [s for s in secrets if s in redact(settings.redis_url)]


@pytest.mark.parametrize(
    "url",
    [
        "redis://:Xq7/Zk9@rhost:6379/0",
        "redis://:Xq7#Zk9@rhost:6379/0",
        "redis://:Xq7?Zk9@rhost:6379/0",
        "redis://:123/Xq7Zk9@rhost:6379/0",
        "redis://Usr4:123?Xq7Zk9@rhost:1/0",
        "redis://Xq7Zk9@rhost:6379/0",
        "redis://:Xq7\nZk9@rhost:6379/0",
        "redis://:Xq7[Zk9@rhost/0",
    ],
)
def test_a_url_whose_password_would_be_misread_is_refused(url: str) -> None:
    assert redis_url_problem(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:p%2Fw%23x%3Fy%40z@rhost:6379/0",  # the same characters, percent-encoded: fine
        "redis://:Xq7@Zk9@rhost:6379/0",  # the last @ ends the userinfo: read as meant
        "redis://Usr4:Xq7Zk9@rhost:6379",
        "rediss://:pw@[::1]:6380/2",
        "unix:///run/redis.sock?db=1",
        "redis://rhost",
        "redis://127.0.0.1:6379/0",
    ],
)
def test_a_well_formed_url_is_accepted(url: str) -> None:
    assert redis_url_problem(url) is None and load_settings(redis_url=url).redis_url


def test_a_redis_url_from_the_config_file_is_not_quoted_in_its_error(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('redis_url = "redis://:Xq7/Zk9@rhost:6379/0"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(config=str(path))
    text = str(err.value)
    assert text.startswith(f"{path}: redis_url = 'redis://***@rhost:6379/0': cannot be parsed"), text
    assert "Xq7" not in text and "Zk9" not in text


def test_redaction_is_total_over_mangled_text() -> None:
    rng = random.Random(21)
    alphabet = "redis:/?#@[]%:.&=ab12\n\x00\u202e\ud800 "
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        out = redact(text)
        assert isinstance(out, str) and out.isprintable()
        problem = redis_url_problem(text)
        assert problem is None or problem.isprintable()


def test_a_connection_error_names_the_url_without_user_or_password() -> None:
    port = free_port()  # nothing listens: refused at once, on loopback
    with pytest.raises(BrokerUnavailable) as err:
        connect(f"redis://Usr4:Xq7%2FZk9@127.0.0.1:{port}/0")
    text = str(err.value)
    assert f"redis://***@127.0.0.1:{port}/0" in text and "Usr4" not in text and "Xq7" not in text


@pytest.mark.parametrize(
    "query",
    [
        "p%61ssword=Xq7Zk9",
        "P%41sSWoRD=Xq7Zk9",
        "%70%61%73%73%77%6F%72%64=Xq7Zk9",  # password, encoded
        "us%65rname=Xq7Zk9",
        "%55sername=Xq7Zk9",  # the user name redis-py reads from the query
        "%74oken=Xq7Zk9",
        "ToK%45n=Xq7Zk9",
        "api_k%65y=Xq7Zk9",
        "KE%59=Xq7Zk9",
        "s%65cret=Xq7Zk9",
        "%61uth=Xq7Zk9",
        "Cr%45d=Xq7Zk9",
        "pass+word=Xq7Zk9",  # '+' is a space in a query: still "pass"
        "db=0&p%61ssword=Xq7Zk9&ssl_cert_reqs=required",
        "p%61ssword%3DXq7Zk9",  # no '=' at all once read: the whole parameter is hidden
    ],
)
def test_a_credential_parameter_is_hidden_when_its_name_is_percent_encoded_or_mixed_case(query: str) -> None:
    out = redact(f"redis://rhost:6379/0?{query}")
    assert "Xq7Zk9" not in out and "***" in out and out.startswith("redis://rhost:6379/0?"), out


def test_a_harmless_parameter_is_shown_whole_even_when_encoded() -> None:
    assert (
        redact("redis://rhost:6379/0?d%62=1&ssl_cert_reqs=required") == "redis://rhost:6379/0?d%62=1&ssl_cert_reqs=required"
    )
