"""Render speeds kept in the store: what ``submit --estimate`` projects a job's time and cost from.

A record per (model, revision, width x height, steps, stages, card, job batch
size) says how many seconds one final image took there (generate and every
stage, the PNG encode aside) as an exponentially weighted mean, and how many
images it rests on.  Two kinds of writer keep it:

* **workers**, from production batches (``worker/accounting/speeds.py``): a batch's render
  time, the one ``render_ms`` counts, added up in memory and merged into the
  record from the shard's commit lane, at most once per :data:`WRITE_SECONDS`
  per key and worker, never on the accelerator's path;
* **``renderfleet bench``** (``worker/bench/run.py``): each batch size it timed, and a
  final image's seconds over its stages.

Records live under ``fleet/speeds/<model digest>/`` so an estimate lists one
model's records, not the fleet's.  Writers do not lock: two workers merging at
once may lose one's minutes of samples (the last write wins), which moves a
mean of thousands of images by little; the store is the only place they share.

Where no record matches exactly, :func:`speed_for` derives a figure from the
closest record of the same model on the same card, scaled by the work of an
image (:func:`work`: megapixels x steps, the stages' too), and says so; with none,
it assumes the model family's default (``Family.seconds_per_mpstep``), or a bench
model's own seconds.  Every figure carries its basis: measured, derived or assumed.

Pure data and pure logic, plus the store's reads and writes: no torch, nothing at import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from renderfleet import families, formats, limits, stages
from renderfleet.limits import bench_seconds
from renderfleet.spec import fleet_key
from renderfleet.stages import Stage

if TYPE_CHECKING:  # the store imports botocore: not for every CLI start
    from renderfleet.store import Store

log = logging.getLogger("renderfleet.speeds")

KIND = "speeds"
MAX_RECORD_BATCH = 4096  # no card renders more images in one call: a record beyond it is forged
# Half of a mean's weight is in its last this-many images: it follows a new driver or card within a
# few thousand images, and one slow batch (a neighbour's burst, a cold cache) moves it by little.
HALF_LIFE_IMAGES = 1000
# A worker merges its figures into a record at most this often per key (one GET and one PUT); a key
# the store has no record of yet, at its first shard's end.  A fleet of 10,000 workers on one key: 17 PUTs a second.
WRITE_SECONDS = 600.0

MEASURED = "measured"  # a record of this model, size, steps, stages, card and batch size
DERIVED = "derived"  # scaled from the closest record (another size, steps, batch; a pool's card unknown)
ASSUMED = "assumed"  # no record to go by: the family's default, or a bench model's stated seconds
BASES = (MEASURED, DERIVED, ASSUMED)  # best first


@dataclass(frozen=True)
class SpeedKey:
    """Where a speed was measured: the model, what an image is, the card and the job's batch size."""

    model: str
    revision: str
    width: int
    height: int
    steps: int
    stages: tuple[Stage, ...]
    card: str  # as a worker names it (worker/accounting/speeds.py, card_for): "NVIDIA H100 80GB HBM3"; '' unknown
    batch: int  # the job's batch size (the most prompts one pipeline call renders)

    def parts(self) -> list[Any]:
        return [
            self.model,
            self.revision,
            self.width,
            self.height,
            self.steps,
            stages.to_json(self.stages),
            self.card,
            self.batch,
        ]

    @property
    def work(self) -> float:
        return work(self.width, self.height, self.steps, self.stages)

    def describe(self) -> str:
        """``1024x1024, 30 steps, batch 4, upscale x2 (Lanczos)``."""
        out = f"{self.width}x{self.height}, {self.steps} steps, batch {self.batch}"
        return out + "".join(f", {stages.describe(s)}" for s in self.stages)


def _model_digest(model: str) -> str:
    return hashlib.sha256(model.encode()).hexdigest()[:16]


def model_prefix(model: str) -> str:
    """Where one model's records are: ``fleet/speeds/<digest of the model>/``."""
    return f"fleet/{KIND}/{_model_digest(model)}/"


def store_key(key: SpeedKey) -> str:
    """``fleet/speeds/<digest of the model>/<digest of the key>.json``."""
    return fleet_key(f"{KIND}/{_model_digest(key.model)}", key.parts(), "json")


@dataclass(frozen=True)
class SpeedRecord:
    """A speed as the store keeps it."""

    key: SpeedKey
    seconds_per_image: float  # exponentially weighted mean (HALF_LIFE_IMAGES)
    images: int  # every image it rests on
    updated: float  # unix time of the last merge
    production: int = 0  # of them, from workers' batches
    bench: int = 0  # from bench runs

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "model": self.key.model,
                "revision": self.key.revision,
                "width": self.key.width,
                "height": self.key.height,
                "steps": self.key.steps,
                "stages": stages.to_json(self.key.stages),
                "card": self.key.card,
                "batch": self.key.batch,
                "seconds_per_image": self.seconds_per_image,
                "images": self.images,
                "updated": self.updated,
                "production": self.production,
                "bench": self.bench,
                formats.KEY: formats.SPEED,  # read back as absent when newer (renderfleet/formats.py)
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> SpeedRecord:
        """A record read back; ValueError (or KeyError, TypeError) when it is not one."""
        try:
            raw = json.loads(data)
        except RecursionError:  # a forged record nested past the recursion limit: not one either
            raise ValueError("not a speed: nested too deeply to read") from None
        if why := formats.newer("the speed record", formats.found(raw), formats.SPEED, "this worker or monitor"):
            raise ValueError(why)  # as a record that is not one: measured anew
        key = SpeedKey(
            model=_typed(raw["model"], str),
            revision=_typed(raw["revision"], str),
            width=_typed(raw["width"], int),
            height=_typed(raw["height"], int),
            steps=_typed(raw["steps"], int),
            stages=stages.from_json(raw["stages"]),
            card=_typed(raw["card"], str),
            batch=_typed(raw["batch"], int),
        )
        spi = float(raw["seconds_per_image"])
        images = _typed(raw["images"], int)
        if not (math.isfinite(spi) and spi > 0 and images > 0 and min(key.width, key.height, key.steps, key.batch) > 0):
            raise ValueError("not a speed: seconds_per_image, images, size, steps and batch must be positive")
        # Within what a job can ask (renderfleet/limits.py): a forged record's huge figure is no speed either.
        if max(key.width, key.height) > limits.MAX_SIDE or key.steps > limits.MAX_STEPS or key.batch > MAX_RECORD_BATCH:
            raise ValueError("not a speed: its size, steps or batch is beyond any job's")
        return cls(
            key,
            spi,
            images,
            float(raw["updated"]),
            int(raw.get("production", 0)),
            int(raw.get("bench", 0)),
        )


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def merge(
    record: SpeedRecord | None, key: SpeedKey, images: int, seconds: float, *, source: str, now: float | None = None
) -> SpeedRecord:
    """``record`` with ``images`` more that took ``seconds`` (``source``: production or bench).

    An exponentially weighted mean by image: the new images' weight is at
    least their share of all the record's images (a young record is a plain
    mean) and at least what :data:`HALF_LIFE_IMAGES` gives them.
    """
    if images <= 0 or not seconds > 0:
        raise ValueError(f"a speed needs images and seconds, got {images} in {seconds} s")
    now = time.time() if now is None else now
    per_image = seconds / images
    counts = {"production": images if source == "production" else 0, "bench": images if source == "bench" else 0}
    if record is None:
        return SpeedRecord(key, per_image, images, now, **counts)
    weight = max(images / (record.images + images), 1 - 0.5 ** (images / HALF_LIFE_IMAGES))
    return SpeedRecord(
        key,
        record.seconds_per_image + weight * (per_image - record.seconds_per_image),
        record.images + images,
        now,
        record.production + counts["production"],
        record.bench + counts["bench"],
    )


# ---- the store ----------------------------------------------------------------------


def read(store: Store, key: SpeedKey) -> SpeedRecord | None:
    """The record of ``key``; None when there is none or it cannot be read (logged)."""
    where = store_key(key)
    try:
        data = store.get(where, max_bytes=limits.MAX_SPEED_RECORD_BYTES)  # over it: a ValueError, logged
        return SpeedRecord.from_json(data) if data else None
    except (ValueError, KeyError, TypeError, ArithmeticError) as exc:
        log.warning("speed record %s not read (%s: %s): written anew", where, type(exc).__name__, exc)
        return None


def add(store: Store, key: SpeedKey, images: int, seconds: float, *, source: str) -> SpeedRecord:
    """Merge ``images`` that took ``seconds`` into ``key``'s record in the store (read, merge, write)."""
    record = merge(read(store, key), key, images, seconds, source=source)
    store.put(store_key(key), record.to_json(), content_type="application/json")
    return record


def records_of(store: Store, model: str) -> list[SpeedRecord]:
    """Every readable record of ``model`` (one listing and a read each; a malformed one skipped, logged)."""
    out = []
    for where in store.list(model_prefix(model)):
        try:
            data = store.get(where, max_bytes=limits.MAX_SPEED_RECORD_BYTES)
            if data:
                record = SpeedRecord.from_json(data)
                if record.key.model == model:
                    out.append(record)
        except (ValueError, KeyError, TypeError, ArithmeticError) as exc:
            log.warning("speed record %s skipped (%s: %s)", where, type(exc).__name__, exc)
    return out


# ---- what an image costs ----------------------------------------------------------------


def work(width: int, height: int, steps: int, job_stages: Sequence[Stage] = ()) -> float:
    """Megapixel-steps of one final image: generate's, then each stage's at the size it runs at.

    A refine runs its denoised steps at the image's size then; a diffusion x4
    upscaler is counted at its output's size (its latents are the input's
    pixels: sixteen times a generate's at that size, for a smaller network);
    a GAN upscaler is one pass at its output's size; a Lanczos resize costs nothing beside them.
    """
    total = width * height * steps / 1e6
    w, h = width, height
    for stage in job_stages:
        if stage.kind == stages.UPSCALE:
            w, h = w * stage.factor, h * stage.factor
            if stage.model:
                total += w * h * (1 if stages.is_gan_upscaler(stage.model) else stage.steps) / 1e6
        else:
            total += w * h * stages.denoised_steps(stage) / 1e6
    return total


@dataclass(frozen=True)
class Speed:
    """Seconds per final image for an estimate, and what the figure rests on."""

    seconds_per_image: float
    basis: str  # MEASURED, DERIVED or ASSUMED
    images: int = 0  # the images it rests on (0: assumed)
    why: str = ""  # one line: from what
    card: str = ""  # the card of the record it came from ('' assumed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds_per_image": self.seconds_per_image,
            "basis": self.basis,
            "images": self.images,
            "why": self.why,
            "card": self.card,
        }


@dataclass(frozen=True)
class Wanted:
    """What an estimate asks a speed for: the key (its card '' when the pool's is not known) and what
    an assumed figure needs besides (the family, the guidance, the negative prompt)."""

    key: SpeedKey
    family: families.Family | None = None
    guidance: float = 7.5
    negative_prompt: str = ""


def speed_for(records: Sequence[SpeedRecord], wanted: Wanted) -> Speed:
    """The figure for ``wanted`` from ``records`` (one model's; :func:`records_of`).

    1. **measured**: a record of the same size, steps, stages, card and batch
       size (of the same revision if there is one, else the one of most images);
    2. **derived**: the closest record of the same model on the same card (on any
       card when the pool's card is not known), scaled by :func:`work`: the
       least change of work per image, then of batch size, then the revision;
    3. **assumed**: a bench model's own seconds, or the family's
       ``seconds_per_mpstep`` times the work (halved where guidance is off on a
       CFG family, doubled by a negative prompt's true CFG), SD's where the
       family is not known.
    """
    want = wanted.key
    mine = [r for r in records if r.key.model == want.model]
    if want.card:
        on_card = [r for r in mine if r.key.card == want.card]
        exact = [r for r in on_card if _same_image(r.key, want) and r.key.batch == want.batch]
        if exact:
            best = max(exact, key=lambda r: (r.key.revision == want.revision, r.images))
            return Speed(
                best.seconds_per_image,
                MEASURED,
                best.images,
                f"{_rests_on(best)}{_revision_note(best, want)}",
                best.key.card,
            )
    else:
        on_card = mine
    if on_card:
        best = min(on_card, key=lambda r: _distance(r.key, want))
        ratio = 1.0 if bench_seconds(want.model) is not None else want.work / best.key.work
        scaled = f", scaled x{ratio:.3g} by megapixel-steps" if ratio != 1.0 else ""
        unknown = "" if want.card else " (the pool's card is not known)"
        return Speed(
            best.seconds_per_image * ratio,
            DERIVED,
            best.images,
            f"from {_rests_on(best)}{scaled}{unknown}{_revision_note(best, want)}",
            best.key.card,
        )
    return assumed(wanted)


def assumed(wanted: Wanted) -> Speed:
    """The figure with nothing measured (:func:`speed_for`, step 3)."""
    want = wanted.key
    seconds = bench_seconds(want.model)
    if seconds is not None:
        return Speed(seconds, ASSUMED, 0, f"the bench model's own {seconds:g} s per image")
    family = wanted.family or families.SD
    factor, how = 1.0, ""
    if family.guidance == "cfg" and wanted.guidance <= 1:
        factor, how = 0.5, ", halved: guidance off runs the denoiser once a step"
    elif family.negative == "true_cfg" and wanted.negative_prompt:
        factor, how = 2.0, ", doubled: a negative prompt's true CFG runs the transformer twice a step"
    named = family.title if wanted.family is not None else f"family unknown, {family.title}'s"
    return Speed(
        family.seconds_per_mpstep * want.work * factor,
        ASSUMED,
        0,
        f"{named} default of {family.seconds_per_mpstep:g} s per megapixel-step on a mid-range card{how}",
    )


def _same_image(a: SpeedKey, b: SpeedKey) -> bool:
    return (a.width, a.height, a.steps, a.stages) == (b.width, b.height, b.steps, b.stages)


def _distance(have: SpeedKey, want: SpeedKey) -> tuple[float, float, bool, float]:
    return (
        round(abs(math.log(have.work / want.work)), 6) if have.work > 0 and want.work > 0 else math.inf,
        abs(math.log(have.batch / want.batch)),
        have.revision != want.revision,
        0.0 if have.stages == want.stages else 1.0,
    )


def _rests_on(record: SpeedRecord) -> str:
    sources = [f"{n:,} from {what}" for what, n in (("production", record.production), ("bench", record.bench)) if n]
    how = f" ({', '.join(sources)})" if sources else ""
    return f"{record.images:,} images{how} at {record.key.describe()} on {record.key.card}"


def _revision_note(record: SpeedRecord, want: SpeedKey) -> str:
    if record.key.revision == want.revision:
        return ""
    return f"; measured at revision {record.key.revision or 'main'}"
