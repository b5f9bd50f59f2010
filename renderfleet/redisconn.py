"""The one way from ``RENDERFLEET_REDIS_URL`` to a Redis client and to Celery's broker.

Two kinds of URL (docs/deployment.md, "Redis Sentinel"):

* a plain Redis: ``redis://``, ``rediss://`` (TLS) or ``unix://``, as redis-py reads it;
* a Sentinel-managed Redis, one URL naming every sentinel and the master's name::

      redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB][?OPTIONS]

  ``rediss+sentinel://`` speaks TLS to the sentinels and to the Redis nodes.  The
  password is the Redis nodes' (``requirepass``); sentinels that want one of their
  own take ``?sentinel_password=``.  A port left out is 26379.  Other options:
  ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (TLS only;
  the server is verified unless ``ssl_cert_reqs=none``).

Why a form of our own rather than kombu's ``sentinel://h1;sentinel://h2`` with the
master's name in ``broker_transport_options``: the fleet's own clients (leases,
feeder, monitor, status) need it as much as Celery does, and one variable must say
all of it.  :func:`client` turns it into redis-py's ``Sentinel(...).master_for(MASTER)``
and :func:`broker` into kombu's URL and transport options.

A Sentinel master client finds the primary by asking the sentinels, and asks again
whenever a connection fails or a node answers ``READONLY`` (a demoted primary):
redis-py raises :class:`redis.ConnectionError` for both (``MasterNotFoundError``
while no primary is elected), which every retry path of ours already treats as
transient (docs/design.md, "Redis failover").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote

from renderfleet.redaction import redact

if TYPE_CHECKING:
    import redis

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
# Asking a sentinel is quick or the sentinel is gone: a dead one must not hold up the next.
SENTINEL_TIMEOUT = 2.0
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_OPTIONS = ("sentinel_password", *_SSL_OPTIONS)
_CERT_REQS = ("required", "optional", "none")
FORM = "redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]"


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL (:func:`parse_sentinel`)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None  # the Redis nodes'
    sentinel_password: str | None = None
    tls: bool = False
    ssl: dict[str, str] = field(default_factory=dict)  # ssl_* options, for TLS only

    def ssl_kwargs(self) -> dict[str, Any]:
        """redis-py's TLS keyword arguments (``ssl=True`` and the ``ssl_*`` options); {} without TLS."""
        if not self.tls:
            return {}
        return {"ssl": True, "ssl_cert_reqs": "required", **self.ssl}


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names a Sentinel-managed Redis."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES and "://" in url


def parse_sentinel(url: str) -> SentinelURL:
    """``url`` (a ``redis+sentinel://`` URL) parsed; a :class:`ValueError` saying what is
    wrong otherwise, which quotes the URL only through :func:`~renderfleet.redaction.redact`."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"must start with redis+sentinel:// or rediss+sentinel://, got {redact(url)!r}")
    if not url.isprintable():
        raise ValueError("contains a control or other unprintable character")
    unparsable = (
        f"cannot be parsed as {FORM} (got {redact(url)!r}); a '/', '?', '#', '@' or ',' in a user "
        "name or password must be percent-encoded as %2F, %3F, %23, %40 or %2C"
    )
    if "#" in rest:
        raise ValueError(unparsable)
    head, _, query = rest.partition("?")
    netloc, _, path = head.partition("/")
    if "@" in path + query:
        raise ValueError(unparsable)  # the host list ended early: at a '/' or '?' in the password
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        if not colon:
            raise ValueError("names a user but no password; a password alone is written redis+sentinel://:PASSWORD@HOST,...")
        username, password = unquote(user) or None, unquote(secret)
    sentinels = tuple(_host(part, unparsable) for part in hostlist.split(","))
    names = [p for p in path.split("/")]
    if not names or not names[0]:
        raise ValueError(f"names no master: the path after the sentinels is the master's name ({FORM})")
    if len(names) > 2 or (len(names) == 2 and not (names[1].isascii() and names[1].isdigit())):
        raise ValueError(f"the path after the sentinels must be MASTER or MASTER/DB, a number ({FORM})")
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _OPTIONS:
            raise ValueError(f"unknown option {name!r} (known: {', '.join(_OPTIONS)})")
        options[name] = value
    tls = scheme.lower() == "rediss+sentinel"
    ssl = {k: v for k, v in options.items() if k in _SSL_OPTIONS}
    if ssl and not tls:
        raise ValueError(f"{', '.join(sorted(ssl))}: TLS options, for rediss+sentinel:// only")
    if ssl.get("ssl_cert_reqs", "required").lower() not in _CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
    return SentinelURL(
        sentinels=sentinels,
        master=unquote(names[0]),
        db=int(names[1]) if len(names) == 2 else 0,
        username=username,
        password=password,
        sentinel_password=options.get("sentinel_password"),
        tls=tls,
        ssl=ssl,
    )


def _host(part: str, unparsable: str) -> tuple[str, int]:
    """One ``HOST[:PORT]`` (``[V6]:PORT`` too) of the sentinel list."""
    if part.startswith("["):
        host, bracket, port = part[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise ValueError(unparsable)
        port = port[1:]
    else:
        host, _, port = part.partition(":")
    if not host:
        raise ValueError(f"names an empty sentinel host: {FORM}")
    if port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):  # '²' is a digit, not to int()
        raise ValueError(unparsable)  # a "port" that is not one: part of a password, maybe
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def sentinel_problem(url: str) -> str | None:
    """Why ``url`` cannot be a ``redis+sentinel://`` URL, if it cannot."""
    try:
        parse_sentinel(url)
    except ValueError as exc:
        return str(exc)
    return None


def client(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url``: ``redis.Redis.from_url`` for a plain URL, the Sentinel
    master client for a ``redis+sentinel://`` one.  ``kwargs`` (``socket_timeout``,
    ``health_check_interval``, ...) go to the connections to the Redis nodes.

    Connects to nothing yet: the first command finds the primary.
    """
    import redis
    from redis.sentinel import Sentinel

    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel(url)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": min(kwargs.get("socket_timeout") or SENTINEL_TIMEOUT, SENTINEL_TIMEOUT),
        "socket_connect_timeout": SENTINEL_TIMEOUT,
        **({"password": parsed.sentinel_password} if parsed.sentinel_password else {}),
        **parsed.ssl_kwargs(),
    }
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
    node: dict[str, Any] = {"db": parsed.db, **parsed.ssl_kwargs(), **kwargs}
    if parsed.password is not None:
        node.update(password=parsed.password, username=parsed.username)
    return sentinel.master_for(parsed.master, redis_class=_master_client_class(), **node)


@functools.cache
def _master_client_class() -> type[redis.Redis]:
    """redis-py's client, closing the :class:`~redis.sentinel.Sentinel` it asks along with itself.

    redis-py leaves a Sentinel's own clients (one per sentinel, a connection each once asked) to
    their owner, and the master client made by ``master_for`` is the only owner we keep: closed
    without them, every client made and dropped (a ping, a status, a monitor's reconnect) would
    hold a connection on each sentinel until the garbage collector found it.  Made on first use:
    nothing is imported at import."""
    import redis

    class SentinelMasterClient(redis.Redis):
        def close(self) -> None:
            try:
                super().close()
            finally:
                manager = getattr(getattr(self, "connection_pool", None), "sentinel_manager", None)
                if manager is not None:
                    manager.close()

    return SentinelMasterClient


def broker(url: str) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """(kombu's broker URL, transport options to add, ``broker_use_ssl``) for ``url``.

    A plain URL goes to kombu as it is.  A sentinel one becomes kombu's ``sentinel://``
    transport: one ``sentinel://[USER:PASSWORD@]HOST:PORT/DB`` per sentinel joined by
    ``;`` (the password on each, since kombu reads it from whichever it is using), the
    master's name and the sentinels' own options in the transport options, and TLS
    through ``broker_use_ssl`` (kombu then uses redis-py's SSL sentinel connection).
    """
    if not is_sentinel(url):
        return url, {}, None
    parsed = parse_sentinel(url)
    auth = ""
    if parsed.password is not None:
        auth = f"{quote(parsed.username or '', safe='')}:{quote(parsed.password, safe='')}@"
    hosts = ";".join(f"sentinel://{auth}{_netloc(host, port)}/{parsed.db}" for host, port in parsed.sentinels)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT,
        "socket_connect_timeout": SENTINEL_TIMEOUT,
        **({"password": parsed.sentinel_password} if parsed.sentinel_password else {}),
        **parsed.ssl_kwargs(),
    }
    options = {"master_name": parsed.master, "sentinel_kwargs": sentinel_kwargs}
    use_ssl = {k: v for k, v in parsed.ssl_kwargs().items() if k != "ssl"} if parsed.tls else None
    return hosts, options, use_ssl


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
