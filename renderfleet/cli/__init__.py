"""The ``renderfleet`` command line: a Typer app, its commands a module per group.

- ``common``: the app itself, the exit statuses (EXIT_INPUT) and the turning of known failures
  into them, the console, settings, logging, the connection, and a job id read back.
- ``options``: the options more than one command takes, each defined once; the job settings
  of ``submit`` and ``run`` (SUBMIT_FLAGS, SubmitFlags, with_submit_flags).
- ``submitting``: ``submit``, its options checked, the stages after generate, ``--estimate``.
- ``jobs``: ``status``, ``results``, ``resume``, ``cancel`` and ``delete``.
- ``fleet``: ``worker`` (or a node of them), ``monitor``, ``scale``, ``autoscale``, ``run``
  (everything on this machine) and the embedded ``server``.
- ``benching``: ``bench`` and ``save-model``.

Importing it registers the commands on the app, in the order ``--help`` lists them, and does
nothing else: each command imports the dispatcher or the worker only when it runs
(tests/unit/test_imports.py).
"""

from renderfleet.cli import benching, fleet, jobs, submitting
from renderfleet.cli.common import EXIT_INPUT, app
from renderfleet.cli.options import SUBMIT_FLAGS, SubmitFlags, with_submit_flags

__all__ = ["EXIT_INPUT", "SUBMIT_FLAGS", "SubmitFlags", "app", "main", "with_submit_flags"]

app.command()(submitting.submit)
app.command()(fleet.worker)
app.command()(jobs.status)
app.command()(jobs.results)
app.command()(jobs.resume)
app.command()(jobs.cancel)
app.command()(jobs.delete)
app.command()(fleet.monitor)
app.command()(fleet.scale)
app.command()(fleet.autoscale)
app.command()(fleet.run)
app.command()(benching.bench)
app.command("save-model")(benching.save_model)
app.command()(fleet.server)


def main() -> None:
    """The ``renderfleet`` console script (pyproject.toml) and ``python -m renderfleet``."""
    app()
