"""The tests' ``renderfleet`` commands, each in its own process, forked from one that imported the CLI once.

A test suite runs about 560 CLI commands (``submit``, ``status``, ``results``...), and a new
interpreter spends about 0.45 of each command's 0.6 CPU-seconds importing pydantic-settings, redis,
Celery, kombu, boto3 and our own modules, the same imports every time: on two cores that is
minutes of the suite.  So :func:`run` forks each command from a server process (multiprocessing's
``forkserver``) that imported them once, and the command still runs as a process of its own: its
own environment (only the test's), arguments, working directory, stdout and stderr (files, read
back), ``python -m renderfleet``'s ``__main__`` (through :func:`runpy.run_module`), its threads
joined and its ``atexit`` handlers run at exit, and its exit status (or the signal that ended it).

What the fork shares is what importing did, which reads nothing of the environment: no module of
ours does anything at import (tests/unit/test_imports.py), and torch, diffusers and transformers
(whose imports do read it) are not preloaded: a command that needs them imports them itself, after
its environment is set.  ``random`` is reseeded in each child (Python does it at every fork).

``pytest --spawn-cli`` runs each command in a new interpreter instead (:data:`spawn`), as a user's
shell would: for a doubt about the difference, the whole suite can be run that way.  The tests that are
about the process itself (``--help``, start-up time, signals, the docs' commands) start their own.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import os
import pkgutil
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

# What the forked commands find imported: every module of the two packages the CLI runs (not the
# worker's, which import torch), and the S3 client's, which the store imports when it first opens.
PACKAGES = ("renderfleet", "dispatcher")
LIBRARIES = ("boto3", "boto3.s3.transfer", "botocore.exceptions", "celery", "kombu", "redis")

# Set by ``pytest --spawn-cli`` (tests/conftest.py): every command in an interpreter of its own.
spawn = False

_forks: multiprocessing.context.ForkServerContext | None = None


def preloaded() -> list[str]:
    """The modules the fork server imports: LIBRARIES, then every module of PACKAGES but ``__main__``."""
    names = list(LIBRARIES)
    for package in PACKAGES:
        path = [str(Path(__file__).resolve().parent.parent / package)]
        names += [info.name for info in pkgutil.walk_packages(path, f"{package}.") if not info.name.endswith("__main__")]
    return names


def _context() -> multiprocessing.context.ForkServerContext:
    global _forks
    if _forks is None:
        forks = multiprocessing.get_context("forkserver")
        forks.set_forkserver_preload(preloaded())
        _forks = forks
    return _forks


def _command(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked process: becomes ``python -m renderfleet ARGS`` in ``env`` and ``cwd``, writing to
    ``out`` and ``err``, and exits as that interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["-m", *args]
    code: object = 0
    try:
        runpy.run_module("renderfleet", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # an uncaught exception: the traceback on stderr and status 1, as the interpreter does
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own: non-daemon threads joined
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


def run(env: dict[str, str], args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m renderfleet ARGS`` with ``env`` in ``cwd``, its output captured (as ``subprocess.run``
    with ``capture_output=True, text=True``); :class:`subprocess.TimeoutExpired` once it has been
    killed past ``timeout``."""
    argv = [sys.executable, "-m", "renderfleet", *args]
    if spawn:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="renderfleet-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        out.touch()
        err.touch()
        process = _context().Process(target=_command, args=(list(args), dict(env), str(cwd), str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(argv, process.exitcode, out.read_text(), err.read_text())
