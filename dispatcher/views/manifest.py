"""``renderfleet results --manifest FILE`` and ``--contact-sheet FILE.png``: results people can use.

The manifest has one row per prompt, in the prompt file's order, written as
Parquet (pyarrow), JSON Lines or CSV by the file's extension.  It is streamed:
rows are built from the stored prompt file as it is read and written in
batches, so a job of a million prompts needs a few megabytes, not gigabytes.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dispatcher.jobs.records import Records
from dispatcher.jobs.resume import load_spec, stored_image_listing, stored_images, stored_names, stored_prompts
from dispatcher.views.thumbs import FORMATS as THUMB_FORMATS
from dispatcher.views.thumbs import THUMB_MAX_PIXELS
from renderfleet import spec
from renderfleet import stages as stagelib
from renderfleet.errors import InputError
from renderfleet.limits import MAX_IMAGE_BYTES, MAX_QUARANTINE_RECORD_BYTES
from renderfleet.spec import Prompt, RenderParams
from renderfleet.store import Store, read_record

COLUMNS = (
    "index",
    "id",
    "prompt",
    "negative_prompt",
    "seed",
    "steps",
    "guidance",
    "width",
    "height",
    "model",
    "scheduler",
    "image_format",
    "image",
    "status",
    "error",
    "shard_attempts",
    "pool",
    "bytes",
    "loras",
    "revision",
    "variant",
    "model_digest",
    # A job with stages (issue 39): its stages as JSON ('' without), and the final image's size (width
    # and height above are what was generated, as the image's metadata records them).
    "stages",
    "final_width",
    "final_height",
    # A rendered prompt's record (dispatcher/jobs/records.py): the attempt of its shard that rendered it, the
    # card, the batch's seconds per image and its share of the cost; empty where not known (a checkpoint
    # from before they were kept, a pool without a price) and for a prompt not rendered.
    "attempt",
    "card",
    "seconds",
    "cost",
)
FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".csv": "csv"}
BATCH_ROWS = 10_000
# A CSV cell starting with one of these is read by Excel, LibreOffice or Sheets as a formula.
CSV_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def manifest_rows(
    store: Store, job: str, attempts: dict[int, int] | None = None, prices: dict[str, float] | None = None
) -> Iterator[dict[str, Any]]:
    """One dict per prompt (``COLUMNS``): its settings, where its image is, done/quarantined/missing,
    and a rendered one's record (``prices``: pool -> price per hour, for its cost share).

    ``attempts`` maps a shard to the times it was handed to a worker (Redis's
    ``keys.attempts``: each claim takes the next attempt number); a shard it
    lacks was never claimed.  None when Redis does not know the job: the
    column is then empty (unknown), never a 0 that reads as "never tried".
    """
    job_spec = load_spec(store, job)
    listed = stored_image_listing(store, job)  # one listing: where each image is and its size
    images = {name: key for name, (key, _) in listed.items()}
    sizes = {name: size for name, (_, size) in listed.items()}
    weights, stages = _job_weights(job_spec.params)
    quarantined = stored_names(store, job, "quarantine") - set(images)
    records = Records(store, job_spec, prices or {})
    for index, (name, line) in enumerate(stored_prompts(store, job_spec)):
        p = Prompt.from_wire(index, json.loads(line), job_spec.params)
        final_width, final_height = stagelib.final_size(job_spec.params.stages, p.width, p.height)
        status, image, error = _outcome(store, job, name, images, quarantined)
        rendered = records.record(index, name, images, {}) if status == "done" else {}
        yield {
            "index": p.index,
            "id": p.name,
            "prompt": p.prompt,
            "negative_prompt": p.negative_prompt,
            "seed": p.seed,
            "steps": p.steps,
            "guidance": p.guidance,
            "width": p.width,
            "height": p.height,
            "model": job_spec.params.model,
            "scheduler": p.scheduler,
            "image_format": job_spec.params.image_format,
            "image": image,
            "status": status,
            "error": error,
            "shard_attempts": None if attempts is None else attempts.get(p.index // job_spec.shard_size, 0),
            "pool": job_spec.pool,
            "bytes": sizes.get(name) if status == "done" else None,
            **weights,
            "stages": stages,
            "final_width": final_width,
            "final_height": final_height,
            "attempt": rendered.get("attempt"),
            "card": rendered.get("card"),
            "seconds": rendered.get("seconds"),
            "cost": rendered.get("cost"),
        }


def _job_weights(params: RenderParams) -> tuple[dict[str, str], str]:
    """The job's weights as its images' metadata records them (LoRAs as JSON [[source, scale], ...]),
    and its stages as each final image's metadata says them (worker/render/runner.py:
    ``renderfleet.stages.to_json``; '' without)."""
    weights = {
        "loras": json.dumps([list(lora) for lora in params.loras], ensure_ascii=False) if params.loras else "",
        "revision": params.revision,
        "variant": params.variant,
        "model_digest": params.model_digest,
    }
    stages = json.dumps(stagelib.to_json(params.stages)) if params.stages else ""
    return weights, stages


def _outcome(store: Store, job: str, name: str, images: dict[str, str], quarantined: set[str]) -> tuple[str, str, str]:
    """A prompt's (status, image, error): done where its image is, quarantined with its record's error, or missing."""
    if name in images:
        return "done", store.locate(images[name]), ""
    if name in quarantined:
        record = read_record(store, spec.quarantine_key(job, name), MAX_QUARANTINE_RECORD_BYTES)
        return "quarantined", "", json.loads(record)["error"] if record else "quarantined"
    return "missing", "", ""


def write_manifest(rows: Iterator[dict[str, Any]], path: Path) -> int:
    """Write ``rows`` to ``path`` by its extension; returns how many.  Written beside, then renamed."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError([f"--manifest {path}: use a .parquet, .jsonl or .csv file"])
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    try:
        if fmt == "parquet":
            count = _write_parquet(rows, tmp)
        else:
            with open(tmp, "w", encoding="utf-8", newline="") as out:
                if fmt == "csv":
                    writer = csv.DictWriter(out, fieldnames=COLUMNS)
                    writer.writeheader()
                    for row in rows:
                        writer.writerow({name: csv_cell(value) for name, value in row.items()})
                        count += 1
                else:
                    for row in rows:
                        out.write(json.dumps(row, ensure_ascii=False) + "\n")
                        count += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell a spreadsheet shows as text: a string starting with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return gets a ``'`` in front (OWASP's advice against CSV
    injection), so a prompt ``=HYPERLINK(...)`` is never run as a formula; anything else as it is.

    Only strings: a number is written by Python (``-1.5``), never a formula.  Parquet and JSON
    Lines are read as data, not evaluated, and keep the text unchanged.
    """
    if isinstance(value, str) and value.startswith(CSV_FORMULA_STARTS):
        return "'" + value
    return value


def _write_parquet(rows: Iterator[dict[str, Any]], path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("index", pa.int64()),
            ("id", pa.string()),
            ("prompt", pa.string()),
            ("negative_prompt", pa.string()),
            ("seed", pa.int64()),
            ("steps", pa.int32()),
            ("guidance", pa.float64()),
            ("width", pa.int32()),
            ("height", pa.int32()),
            ("model", pa.string()),
            ("scheduler", pa.string()),
            ("image_format", pa.string()),
            ("image", pa.string()),
            ("status", pa.string()),
            ("error", pa.string()),
            ("shard_attempts", pa.int32()),
            ("pool", pa.string()),
            ("bytes", pa.int64()),
            ("loras", pa.string()),
            ("revision", pa.string()),
            ("variant", pa.string()),
            ("model_digest", pa.string()),
            ("stages", pa.string()),
            ("final_width", pa.int32()),
            ("final_height", pa.int32()),
            ("attempt", pa.int32()),
            ("card", pa.string()),
            ("seconds", pa.float64()),
            ("cost", pa.float64()),
        ]
    )
    count = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= BATCH_ROWS:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                count += len(batch)
                batch.clear()
        if batch or not count:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            count += len(batch)
    return count


def contact_sheet(store: Store, job: str, path: Path, *, limit: int = 100, thumb: int = 128) -> int:
    """A grid of the job's first ``limit`` images with their ids, as one PNG; returns how many.

    Every image fills its cell (``thumb`` px on its longer side): a large one is shrunk as the
    gallery's thumbnails are, a small one (a 64x64 smoke test) is enlarged.  An image too large
    to decode, or unreadable, gets a grey cell (:func:`fit_cell`).
    """
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise InputError(["--contact-sheet: needs Pillow (pip install 'renderfleet[worker]' or pillow)"]) from None
    stored = stored_images(store, job)
    names = sorted(stored)[:limit]
    if not names:
        raise InputError([f"--contact-sheet: job {job} has no images yet"])
    cols = min(10, len(names))
    rows = math.ceil(len(names) / cols)
    label = 14
    sheet = Image.new("RGB", (cols * thumb, rows * (thumb + label)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, name in enumerate(names):
        data = read_record(store, stored[name], MAX_IMAGE_BYTES)
        if data is None:
            continue
        tile = fit_cell(data, thumb)
        x, y = (i % cols) * thumb, (i // cols) * (thumb + label)
        sheet.paste(tile, (x + (thumb - tile.width) // 2, y + (thumb - tile.height) // 2))
        draw.text((x + 2, y + thumb + 1), name[:20], fill="black")
    tmp = path.with_name(f".{path.name}.tmp.png")
    sheet.save(tmp, format="PNG")
    os.replace(tmp, path)
    return len(names)


def fit_cell(data: bytes, cell: int, max_pixels: int = THUMB_MAX_PIXELS) -> Any:
    """The image in ``data`` scaled to fill a ``cell`` x ``cell`` square, its aspect kept.

    Decoding is bounded as the gallery's is (dispatcher/views/thumbs.py): the size is read from the
    header first and an image over ``max_pixels`` is not decoded; a JPEG decodes reduced; a
    large image is shrunk by ``thumbnail`` (an integer ``reduce`` first, then Lanczos).  A
    small one is enlarged with nearest-neighbour: its own pixels, bigger, nothing invented.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=THUMB_FORMATS) as image:
            if image.width * image.height > max_pixels:
                return Image.new("RGB", (cell, cell), (200, 200, 200))
            image.draft("RGB", (cell, cell))
            tile = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
        return Image.new("RGB", (cell, cell), (200, 200, 200))
    if max(tile.size) > cell:
        tile.thumbnail((cell, cell), Image.Resampling.LANCZOS)
        return tile
    scale = cell / max(tile.size)
    size = (max(1, round(tile.width * scale)), max(1, round(tile.height * scale)))
    return tile.resize(size, Image.Resampling.NEAREST)
