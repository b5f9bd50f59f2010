"""``submit`` and what it shares with ``run`` and ``bench``: a submit's checked options from its
flags, the stages after generate, the submit itself through the Python API, ``--estimate``, and
standard input copied to a prompt file."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from renderfleet.cli.common import _err, _logging, _settings, _user_errors
from renderfleet.cli.options import (
    ConfigOpt,
    Estimate,
    EstimateJson,
    Format,
    PromptFile,
    SubmitFlags,
    Webhook,
    with_submit_flags,
)
from renderfleet.errors import InputError
from renderfleet.settings import Settings
from renderfleet.words import counted


def _submit_options(flags: SubmitFlags, settings: Settings, model: str | None = None, webhook: str | None = None) -> Any:
    """The checked options of a submit from its flags (``model``: in place of ``flags.model``; ``webhook``: submit's)."""
    from renderfleet.api import Client

    render = _render(flags.scheduler, flags.long_prompts, flags.image_format, flags.quality)
    if flags.lora:
        render["loras"] = flags.lora
    render.update({k: v for k, v in (("revision", flags.revision), ("variant", flags.variant)) if v})
    if stage_list := _stage_flags(flags):
        render["stages"] = stage_list
    if flags.keep_intermediates:
        render["keep_intermediates"] = 1
    return Client(settings).options(
        model=model or flags.model,
        steps=flags.steps,
        size=flags.size,
        guidance=flags.guidance,
        negative=flags.negative,
        seed=flags.seed,
        shard_size=flags.shard_size,
        batch_size=flags.batch_size,
        pool=flags.pool or "default",
        job=flags.job,
        priority=flags.priority,
        share=flags.share,
        name=flags.name,
        budget=flags.budget,
        min_vram=flags.min_vram,
        quantize=flags.quantize,
        webhook=webhook,
        **render,
    )


def _stage_flags(flags: SubmitFlags) -> list[Any]:
    """The job's stages from its flags (:func:`_stages_of`)."""
    return _stages_of(flags.upscale, flags.refine, flags.stages)


def _stages_of(upscale: list[str] | None, refine: list[str] | None, stages_file: Path | None) -> list[Any]:
    """The stages after generate from ``--stages FILE``, or ``--upscale`` and ``--refine`` in the order the
    command line gives them (typer gathers each option's values apart; the order is read back from argv,
    and where argv does not hold them, as when called from Python, upscales come first).  Submit's, run's
    and bench's alike."""
    from renderfleet import stages

    given = [*(upscale or []), *(refine or [])]
    if stages_file is not None:
        if given:
            raise InputError(["--stages: give the stages in the file or as --upscale/--refine, not both"])
        return list(stages.read_file(str(stages_file)))
    order = [arg.partition("=")[0] for arg in sys.argv[1:] if arg.partition("=")[0] in ("--upscale", "--refine")]
    if sorted(order) != sorted(["--upscale"] * len(upscale or []) + ["--refine"] * len(refine or [])):
        order = ["--upscale"] * len(upscale or []) + ["--refine"] * len(refine or [])
    upscales, refines = iter(upscale or []), iter(refine or [])
    return [
        stages.parse_upscale(next(upscales)) if flag == "--upscale" else stages.parse_refine(next(refines)) for flag in order
    ]


def _render(scheduler: str, long_prompts: str, image_format: str, quality: int) -> dict[str, Any]:
    """The render settings of the one table that submit and run take as flags, by their names."""
    return {"scheduler": scheduler, "long_prompts": long_prompts, "image_format": image_format, "quality": quality}


def _do_submit(
    file: Path, opts: Any, settings: Settings, summary: Any = None, stream: Any = None, fmt: str | None = None
) -> Any:
    """Submit through the Python API (:class:`renderfleet.api.Client`): the CLI is a thin layer over it."""
    from renderfleet.api import Client

    client = Client(settings)
    if stream is not None:
        job = client.submit(
            stream,
            format=fmt,
            model=opts.params.model,
            steps=opts.params.steps,
            size=(opts.params.width, opts.params.height),
            guidance=opts.params.guidance,
            negative=opts.params.negative_prompt,
            seed=opts.params.seed,
            shard_size=opts.shard_size,
            batch_size=opts.batch_size,
            pool=opts.pool,
            job=opts.job,
            priority=opts.priority,
            share=opts.share,
            name=opts.name,
            budget=opts.budget,
            min_vram=opts.min_vram or None,
            quantize=opts.quantize or None,
            **_render(opts.params.scheduler, opts.params.long_prompts, opts.params.image_format, opts.params.quality),
            loras=opts.params.loras,
            revision=opts.params.revision,
            variant=opts.params.variant,
            stages=opts.params.stages,
            keep_intermediates=opts.params.keep_intermediates,
            webhook=opts.webhook or None,
        )
    else:
        job = client.submit_file(str(file), opts, summary=summary)  # validated before any server starts
    for note in job.warnings:
        _err(note)
    return job


@with_submit_flags()
def submit(
    file: PromptFile,
    fmt: Format = None,
    estimate: Estimate = False,
    as_json: EstimateJson = False,
    webhook: Webhook = None,
    config: ConfigOpt = None,
    *,
    flags: SubmitFlags,
) -> None:
    """Validate a prompt file, write the job to the store and enqueue it. Prints the job id last."""
    settings = _settings(config=config)
    _logging(settings)
    with _user_errors():
        opts = replace(_submit_options(flags, settings, webhook=webhook), format=fmt or "")
        if estimate or as_json:
            _estimate(file, fmt, opts, settings, as_json=as_json, asked=estimate)
            return
        if str(file) == "-":
            if fmt is None:
                raise InputError(["--format: required with - (txt, jsonl or csv)"])
            result = _do_submit(file, opts, settings, stream=sys.stdin.buffer, fmt=fmt)
        else:  # a --format must be the name's (prompts.validate_file)
            result = _do_submit(file, opts, settings)
    verb = "submitted" if result.new else "resubmitted"
    _err(
        f"{verb} {counted(result.total, 'prompt')} as job {result.id}: "
        f"{counted(result.shards_enqueued, 'shard')} enqueued in {result.seconds:.2f} s"
    )
    print(result.id)


def _estimate(file: Path, fmt: str | None, opts: Any, settings: Settings, *, as_json: bool, asked: bool) -> None:
    """``submit --estimate``: nothing queued, nothing written (dispatcher/views/estimate.py)."""
    from dispatcher.views.estimate import text
    from renderfleet.api import Client

    if not asked:
        raise InputError(["--json: only with --estimate (a submit prints the job id)"])
    client = Client(settings)
    if str(file) == "-":
        with _stdin_file(fmt, "rf-estimate-") as path:
            found = client.estimate_file(str(path), opts)
    else:
        found = client.estimate_file(str(file), opts)
    print(json.dumps(found.to_dict(), indent=2) if as_json else text(found), end="\n" if as_json else "")


@contextmanager
def _stdin_file(fmt: str | None, prefix: str) -> Iterator[Path]:
    """Standard input copied to a prompt file of format ``fmt`` (``--format``, required with -);
    the problems found in it name ``<stdin>``, not the copy."""
    import shutil
    import tempfile

    if fmt is None:
        raise InputError(["--format: required with - (txt, jsonl or csv)"])
    if fmt not in ("txt", "jsonl", "csv"):
        raise InputError([f"--format: give txt, jsonl or csv, got {fmt!r}"])
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = Path(tmp) / f"prompts.{fmt}"
        with open(path, "wb") as out:
            shutil.copyfileobj(sys.stdin.buffer, out, 1 << 20)
        try:
            yield path
        except InputError as exc:
            raise InputError([line.replace(str(path), "<stdin>") for line in exc.problems]) from None
