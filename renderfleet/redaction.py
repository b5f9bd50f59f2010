"""URLs fit for a message or a log line: their credentials shown as ``***``.

Below both the settings (which check the Redis URL) and the Redis connection
(which parses a Sentinel URL), so neither imports the other for it;
``renderfleet.settings.redact`` is the same function.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit

# Query parameters that may carry a credential (redis-py reads ?password= and ?username=).
_SECRET_PARAM = re.compile(r"pass|secret|token|auth|user|cred|key", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` fit for a message or a log line: its user name and password (the
    whole userinfo) and any credential in its query shown as ``***``.

    Total: whatever the text, it returns and never raises, and it shows none of
    the userinfo even when a password holds an unencoded ``/``, ``?``, ``#`` or
    ``@`` (a parser such as urllib's would then read part of the password as the
    host, the port or the path).  So it parses nothing: the userinfo is what
    comes before an ``@``, and when an ``@`` comes after where the host seems
    to end, everything up to the last ``@`` is taken as userinfo (more hidden,
    never less).  Characters that could break or reorder a line are escaped.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    if "@" in rest[end:]:  # an unencoded / ? or # in the userinfo
        rest = "***" + rest[rest.rindex("@") :]
    elif "@" in rest[:end]:
        rest = "***" + rest[rest.rindex("@", 0, end) :]
    head, hash_mark, _ = rest.partition("#")
    base, question, query = head.partition("?")
    if query:
        query = "&".join(_redact_param(param) for param in query.split("&"))
    shown = f"{scheme}{sep}{base}{question}{query}" + ("#***" if hash_mark else "")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in shown)


def _redact_param(param: str) -> str:
    name, equals, _ = param.partition("=")
    # Matched as a parser reads it (redis-py's parse_qs decodes names): "p%61ssword" is "password".
    # unquote_plus never raises; a bad escape stays as it is.
    if not equals:  # "password%3Dsecret": no name and value to a parser, but a secret to a reader
        return "***" if _SECRET_PARAM.search(unquote_plus(param)) else param
    return f"{name}=***" if _SECRET_PARAM.search(unquote_plus(name)) else param


def shown_target(url: str | None) -> str:
    """A receiver as ``status`` shows it: scheme, host and port, no path or query (they may hold a token)."""
    if not url:
        return "-"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
