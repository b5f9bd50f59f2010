"""Signed events, the contract: what a job's webhook may be, the events' types and ids, the secret.

A job may name a receiver (``submit --webhook URL``; the config's ``[events]
webhook`` for every job that names none).  The monitor tells it when the job
started, finished a stage, had prompts quarantined, was cancelled, reached its
budget or finished (``dispatcher/events/events.py`` sees the transitions,
``dispatcher/events/courier.py`` delivers them), each event signed by the Standard
Webhooks scheme (``standardwebhooks``: an id, a timestamp and an HMAC-SHA256
signature in headers), at least once: a receiver dedupes by the id.

Here is what both sides of that share: the checks of a receiver's URL (submit
and the settings check its form; the courier checks every address it would
connect to, since a name may resolve elsewhere by then), the event types, and
the id, deterministic per job life and transition, so that a monitor that
restarts and sees a transition again mints the same id, never a second event.
Nothing happens at import.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from renderfleet.errors import ConfigError

if TYPE_CHECKING:
    from standardwebhooks import Webhook

MAX_URL_LENGTH = 2000  # characters: what every HTTP stack takes in a request line
SECRET_PREFIX = "whsec_"  # the scheme's form of a secret: whsec_ then its bytes in base64
MIN_SECRET_BYTES = 24  # the scheme asks for 24 to 64 random bytes


class EventType(StrEnum):
    """Each event's ``type`` (in the body, and the ``event:`` of the page's stream)."""

    STARTED = "job.started"  # the first prompt rendered, quarantined or running
    STAGE_FINISHED = "job.stage_finished"  # a job with stages: one stage made an image for every prompt left
    PROMPTS_QUARANTINED = "job.prompts_quarantined"  # more prompts quarantined than the last such event said
    CANCELLED = "job.cancelled"  # renderfleet cancel (each cancel of a life: its own event)
    BUDGET_REACHED = "job.budget_reached"  # its spend reached its budget (each cap reached: its own event)
    FINISHED = "job.finished"  # every prompt rendered or quarantined, or the job failed as a whole


class Delivery(StrEnum):
    """How an event's delivery stands (its ``state`` in ``keys.job_events``)."""

    PENDING = "pending"  # a receiver is named and has not taken it yet: kept in the store until it does
    DELIVERED = "delivered"  # its receiver answered 2xx
    UNSENT = "unsent"  # no receiver named: on the page's stream only


# What the key that authenticates the store's copies of events is derived from (the fleet's secret's
# bytes are its key): another use of the secret, so a signature of one can never pass for the other.
RECORD_KEY_LABEL = b"renderfleet event record v1"


def record_key(secret: bytes) -> bytes:
    """The key of the MAC that each stored copy of an event carries (``dispatcher/events/events.py``):
    HMAC-SHA256 of :data:`RECORD_KEY_LABEL` under the fleet's signing secret.  The store is writable
    by tenants; a copy without a MAC under this key was not minted by this fleet's monitor."""
    return hmac.new(secret, RECORD_KEY_LABEL, hashlib.sha256).digest()


def receiver_id(url: str) -> str:
    """How an event's body names the receiver it was minted for (its ``receiver``): the SHA-256 of
    the receiver's URL, exactly as given (``submit --webhook``, ``[events] webhook``), in hex.  A hash,
    not the URL: the body is shown on the page's stream too, and a URL may hold a token.  A receiver
    compares it with the hash of its own URL and refuses an event meant for another one (a replay
    of a captured event to another receiver that trusts the same secret)."""
    return hashlib.sha256(url.encode()).hexdigest()


def event_id(job: str, life: str, key: str) -> str:
    """The event's id (the ``webhook-id`` header): the same for the same job, life and transition
    (``key``: ``started``, ``stage:upscale-1``, ``quarantined:12``, ``cancelled:<time>``, ...), so that a
    monitor that sees a transition again after a restart mints the event it minted before."""
    digest = hashlib.sha256(f"{job}\n{life}\n{key}".encode()).hexdigest()[:32]
    return f"evt_{digest}"


def _address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why the fleet will not post to ``address`` unless ``events.allow_private`` is set: one that is not
    on the public internet (loopback, private, link-local such as the cloud metadata service at
    169.254.169.254, shared, reserved, multicast): a webhook is never a way into the fleet's own network."""
    embedded = _embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else None
    if embedded is not None and (why := _address_problem(embedded)):
        return f"{address} carries an IPv4 address: {why}"
    if address.is_loopback:
        return f"{address} is a loopback address"
    if address.is_link_local:
        return f"{address} is a link-local address (the cloud metadata service is one)"
    if address.is_multicast or address.is_unspecified:
        return f"{address} is not a host's address"
    if not address.is_global:
        return f"{address} is a private or reserved address"
    return None


_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT's ::ffff:0:a.b.c.d (RFC 2765), not ipv4_mapped


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches through a translator or tunnel (IPv4-mapped ``::ffff:0:0/96``,
    SIIT's IPv4-translated ``::ffff:0:0:0/96``, NAT64's well-known and local prefixes, 6to4, Teredo's client,
    IPv4-compatible), or None: a NAT64 gateway turns ``64:ff9b::a9fe:a9fe`` into 169.254.169.254, so the
    IPv4 address is the one checked."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if (
        any(address in net for net in _NAT64)
        or address in _IPV4_TRANSLATED
        or (address in _IPV4_COMPATIBLE and int(address) > 1)
    ):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_problem(address: str, *, allow_private: bool) -> str | None:
    """Why an address a receiver's name resolved to must not be posted to (None: it may)."""
    if allow_private:
        return None
    try:
        parsed = ipaddress.ip_address(address.partition("%")[0])  # an IPv6 zone index is not the address
    except ValueError:
        return f"{address!r} is not an IP address"
    return _address_problem(parsed)


PRIVATE_HINT = "events.allow_private = true in the config lets a fleet post to its own network (tests, a receiver beside it)"


def url_problem(url: str, *, allow_private: bool) -> str | None:
    """Why ``url`` cannot be a receiver of events, in a phrase (None: it can): http or https only, a
    host, no user name or password (they would show in logs and ``status``: put a token in the path
    or query), and, unless ``allow_private``, no loopback or private address nor ``localhost``.
    A name is not resolved here: the courier checks every address at each delivery."""
    if not isinstance(url, str) or not url:
        return "must be an http:// or https:// URL, got nothing"
    if len(url) > MAX_URL_LENGTH:
        return f"at most {MAX_URL_LENGTH} characters, got {len(url)}"
    shown = url[:100]
    if not url.isprintable() or any(c.isspace() for c in url):
        return f"contains whitespace or an unprintable character: {shown!r}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        return f"cannot be parsed as a URL ({exc}): {shown!r}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"must be an http:// or https:// URL, got {shown!r}"
    if not parts.hostname:
        return f"names no host: {shown!r}"
    if parts.username is not None or parts.password is not None:
        return "carries a user name or password (they would show in logs and status): put a token in the path or query"
    if allow_private:
        return None
    host = parts.hostname.lower()
    if host == "localhost" or host.endswith(".localhost"):
        return f"{host} is this machine; {PRIVATE_HINT}"
    try:
        literal = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None  # a name: checked at each delivery, as it resolves then
    if why := _address_problem(literal):
        return f"{why}; {PRIVATE_HINT}"
    return None


def secret_bytes(path: Path, where: str) -> bytes:
    """The fleet's signing key's bytes from ``path`` (``whsec_`` and its bytes in base64, the scheme's
    form; what ``openssl rand -base64 32`` prints, prefixed, will do); ConfigError naming ``where`` (the
    setting and its value) when it cannot be read or is not one.  The key itself is never shown."""
    import base64
    import binascii

    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    body = text.removeprefix(SECRET_PREFIX)
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True) if body else b""
    except (binascii.Error, ValueError):
        raw = b""
    if not text.startswith(SECRET_PREFIX) or len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where}: must hold {SECRET_PREFIX} and at least {MIN_SECRET_BYTES} random bytes in base64 "
            f"(e.g. `echo {SECRET_PREFIX}$(openssl rand -base64 32)`)"
        )
    return raw


def read_secret(path: Path, where: str) -> Webhook:
    """The Standard Webhooks signer of the fleet's secret at ``path`` (:func:`secret_bytes`)."""
    from standardwebhooks import Webhook

    return Webhook(secret_bytes(path, where))
