"""What every command of the CLI shares: the Typer app, the exit statuses and the turning of known
failures into them, the console, settings and logging, the connection, and a job id read back.

Every command builds one :class:`~renderfleet.settings.Settings` from its
flags and the environment.  User mistakes (bad files, bad flags, unknown jobs)
end with a message and a non-zero exit status, never a traceback: exit 2 for
bad input, 1 for anything else that went wrong.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, cast

import typer

from renderfleet.errors import ConfigError, InputError, JobNotFound, RenderfleetError
from renderfleet.settings import Settings, load_settings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Render one image per prompt on a fleet of GPU workers, each exactly once.",
)

EXIT_INPUT = 2


def _print_version(value: bool) -> None:
    if value:
        from renderfleet import __version__

        print(f"renderfleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print renderfleet's version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Render one image per prompt on a fleet of GPU workers, each exactly once."""


def _err(text: str) -> None:
    print(text, file=sys.stderr)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Known failures become a message and an exit status."""
    import redis

    try:
        yield
    except InputError as exc:
        for line in exc.problems:
            _err(line)
        raise typer.Exit(EXIT_INPUT) from None
    except ConfigError as exc:
        _err(f"renderfleet: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    except JobNotFound as exc:
        _err(f"renderfleet: {exc}")
        raise typer.Exit(1) from None
    except RenderfleetError as exc:
        _err(f"renderfleet: {exc}")
        raise typer.Exit(1) from None
    except redis.RedisError as exc:
        _err(f"renderfleet: Redis: {exc}")
        raise typer.Exit(1) from None


class _LineEndsStripped:
    """Standard output for a rich table printed to a pipe or a file: each line without the spaces
    rich pads its last column with (a terminal shows none; ``grep``, ``diff`` and a log keep them)."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._held = ""  # spaces at the end of what was written, kept until the line goes on or ends

    @property
    def encoding(self) -> str:
        return str(getattr(self._out, "encoding", None) or "utf-8")

    def write(self, text: str) -> int:
        *ended, last = (self._held + text).split("\n")
        for line in ended:
            self._out.write(line.rstrip(" ") + "\n")
        kept = last.rstrip(" ")
        self._out.write(kept)
        self._held = last[len(kept) :]
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def isatty(self) -> bool:
        return False


def _console() -> Any:
    """A rich Console on standard output: as it is on a terminal, its lines' ends stripped elsewhere."""
    from rich.console import Console

    # The wrapper has what rich uses of a file (write, flush, isatty, encoding), not all of IO.
    return Console() if sys.stdout.isatty() else Console(file=cast("IO[str]", _LineEndsStripped(sys.stdout)))


def _settings(**overrides: Any) -> Settings:
    with _user_errors():
        return load_settings(**overrides)


def _logging(settings: Settings, verbose: bool = False) -> None:
    """One handler on stderr, as text or JSON lines (RENDERFLEET_LOG_FORMAT): renderfleet.logs."""
    from renderfleet import logs

    logs.setup(logging.INFO if verbose else logging.WARNING, settings.log_format)


def _connect(settings: Settings) -> tuple[Any, Any, str]:
    """(celery app, redis client, broker url), starting the embedded server if needed."""
    from renderfleet.celery_app import make_app
    from renderfleet.embedded import broker_url, connect

    url = broker_url(settings.redis_url, settings.home)
    return make_app(url), connect(url), url


def _job_id(settings: Settings, job: str, client: Any = None, store: Any = None) -> str:
    """The job ``job`` names: its id, or a unique prefix of one (as ``status`` shows it; an
    ambiguous one is an InputError naming the candidates).  ``client``: the Redis to ask (default:
    the configured one, or the embedded one if it runs; never started for this)."""
    from dispatcher.views.jobids import resolve
    from renderfleet.embedded import connect, running_embedded
    from renderfleet.store import open_store

    if client is None:  # a plain connection: no Celery app is made for this (delete's refusal is quick)
        url = settings.redis_url or running_embedded(settings.home)
        client = connect(url) if url else None
    return resolve(client, store or open_store(settings.store_url, settings.s3_options), job)
