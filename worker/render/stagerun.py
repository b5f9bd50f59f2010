"""A shard's stages after generate, run per batch and checkpointed per stage (issue 39).

The shard runner (worker/render/runner.py) generates a batch's images as always; when the job has stages
(``RenderParams.stages``: upscale, refine) it hands them here before they are committed. Each stage
runs on the images the one before made, batched as the job's batch is, and what a stage made is
written to the store before the next begins, as lossless PNG under the shard's own prefix
(``spec.stage_key``, under the job's life: never an older life's): a worker lost in the third stage
leaves the second's images, and the next delivery of the shard takes them from there (one listing
per shard, :meth:`ShardStages.levels`), never generating or refining them again. The last stage's
images are the job's final images, committed by the runner as before; once a final image is stored
its intermediates are deleted (:meth:`ShardStages.forget`).

A job whose stages run on pools of their own (``renderfleet.stages.segments``) is rendered a segment at a
time: a segment before the last stops at its level (``ShardMessage.until``) and stores it, and the next
segment's worker, on its own pool, takes the images from that level as any later delivery would.

Where the next stage takes latents (a refine on a model of the same latent space: SDXL's base to
its refiner, or the job's own model; ``renderfleet.stages.hands_latents`` decides, in one place),
the level is the latents themselves, stored as safetensors (never a pickle) under a key whose
extension says so (``spec.stage_key``): the hand-off loses nothing and skips a decode and an encode.

Each stage runs a batch in calls of its own size (``worker.render.batchsize.BatchSizes.stage_size_for``:
probed on the card and remembered per stage, halved on out-of-memory for that stage alone); the
job's batch stays the unit of commit: a stage's calls together make the batch's level before the
next stage begins.

Every stage draws its noise from the prompt's seed and the stage's position
(``renderfleet.stages.stage_seed``), and PNG and safetensors keep every value, so what is taken back
from the store is what was stored: a redelivered shard comes out byte-identical.  Levels: 0 is
the generated image, ``k`` the image after stage ``k`` (1-based); the last level is never stored
here.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import pydantic_core

from renderfleet import failpoints, spec
from renderfleet.errors import JobError, ModelLoadError, OutOfMemory, PermanentError, PromptError, Reclaimed
from renderfleet.limits import MAX_IMAGE_BYTES, MAX_SIDE
from renderfleet.spec import Prompt, ShardMessage
from renderfleet.stages import REFINE, Stage, final_size, hands_latents, kinds_hand_latents, next_stage
from renderfleet.store import Store, read_record, withdraw
from worker.render import outputs
from worker.render.batchsize import WHOLE_BATCH, BatchSizes

log = logging.getLogger("renderfleet.runner")

StageFactory = Callable[[Stage, int], Any]  # (stage, its index from 0) -> a worker.render.stages.StageRenderer
StageHook = Callable[[str, int, float], None]  # (stage_label, images made, seconds its calls took)
Failure = tuple[Prompt, str, bool]  # (prompt, reason, the node's fault?)


def stage_label(stages: Sequence[Stage], level: int) -> str:
    """What made the images of ``level``: ``generate``, or ``upscale-1``, ``refine-2`` (kind and position)."""
    return "generate" if level == 0 else f"{stages[level - 1].kind}-{level}"


LATENTS = "latents"  # the one tensor of a level's safetensors


def is_latents(image: Any) -> bool:
    """Whether a level is latents (a tensor), not a PIL image."""
    return hasattr(image, "dtype") and hasattr(image, "shape")


def shape_of(image: Any) -> tuple[Any, ...]:
    """What a stage's inputs must share to go in one call: ``("image", width, height)`` or ``("latent", C, h, w)``."""
    return ("latent", *image.shape) if is_latents(image) else ("image", *image.size)


def encode_intermediate(image: Any) -> bytes:
    """A level between stages: an image as lossless PNG with nothing but its pixels (no clock, no text);
    latents as safetensors, their values and dtype as they are (the same tensor, the same bytes)."""
    if is_latents(image):
        from safetensors.torch import save

        return save({LATENTS: image.detach().to("cpu").contiguous().clone()})
    out = io.BytesIO()
    outputs.to_pil(image).save(out, format="PNG", compress_level=1)  # generate's 8-bit pixels made PIL here
    return out.getvalue()


_LATENT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4}  # what a pipeline's latents are in (bytes per value)
MAX_LEVEL_HEADER_BYTES = 4096  # a level's safetensors header: one tensor, a few dozen bytes


def level_problem(data: bytes, latents: bool, size: tuple[int, int] | None) -> str | None:
    """Why stored bytes are not a level of an image of ``size`` (width, height; None: unchecked), if
    they are not: checked before a pixel or a value is decoded.  Latents: a safetensors of the one
    :data:`LATENTS` tensor, a float dtype, (channels, height / f, width / f) for one factor f, its bytes
    exactly those; an image: a PNG of exactly ``size`` (a stored level is never of another)."""
    if not latents:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data), formats=["PNG"]) as image:  # its header only
                if size is not None and image.size != size:
                    return f"a {image.size[0]}x{image.size[1]} image, not {size[0]}x{size[1]}"
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
            return f"not a PNG ({type(exc).__name__})"
        return None
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    if not 2 <= length <= min(MAX_LEVEL_HEADER_BYTES, len(data) - 8):
        return "not a safetensors of latents (its header's length)"
    try:
        header = pydantic_core.from_json(data[8 : 8 + length])
    except ValueError:
        return "not a safetensors of latents (its header is no JSON)"
    if not isinstance(header, dict):
        return "not a safetensors of latents (its header is no JSON object)"
    entry = header.pop(LATENTS, None)
    header.pop("__metadata__", None)
    if header or not isinstance(entry, dict) or entry.get("dtype") not in _LATENT_DTYPES:
        return f"not a safetensors of latents (one float tensor named {LATENTS!r})"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(n) is int and 0 < n <= MAX_SIDE for n in shape)):
        return "latents of another shape than (channels, height, width)"
    if offsets != [0, len(data) - 8 - length] or offsets[1] != math.prod(shape) * _LATENT_DTYPES[entry["dtype"]]:
        return "latents whose bytes are not their shape's"
    channels, height, width = shape
    if size is not None and not (
        channels <= 16 and size[0] % width == 0 and size[1] % height == 0 and size[0] // width == size[1] // height
    ):
        return f"latents of shape {shape}, not those of a {size[0]}x{size[1]} image"
    return None


def decode_level(data: bytes, latents: bool, size: tuple[int, int] | None, where: str) -> Any | None:
    """A stored level (:func:`decode_intermediate`) if the bytes are one (:func:`level_problem`, and latents'
    values finite); else None after one WARNING line naming ``where``: absent, the level made again."""
    why = level_problem(data, latents, size)
    if why is None:
        try:
            level = decode_intermediate(data, latents)
            if latents and not bool(level.isfinite().all()):
                why = "latents that are not all finite"
            else:
                return level
        except Exception as exc:  # a library's own error on bytes the checks let by: absent all the same
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
    log.warning("skipping %s: not a stored level (%s): made again", where[:300], why)
    return None


def decode_intermediate(data: bytes, latents: bool = False) -> Any:
    """A stored level back: a PIL image, or (``latents``) the tensor, on the CPU (the pipeline moves it)."""
    if latents:
        from safetensors.torch import load

        return load(data)[LATENTS]
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB").copy()


def level_may_be_latents(stages: Sequence[Stage], level: int) -> bool:
    """Whether a level's stored key may be latents: only what goes to a refine can be
    (``hands_latents``), so a load or delete of any other level looks for a PNG alone."""
    return level < len(stages) and stages[level].kind == REFINE


def _level_members(prompts: Sequence[Prompt], current: dict[str, Any], at: dict[str, int], level: int) -> list[Prompt]:
    """The prompts at ``level`` that its stage takes; a prompt that skips this stage (its skip_stages) goes to the
    next level as it is (``at``)."""
    members = [p for p in prompts if p.name in current and at.get(p.name, 0) == level]
    skipping = [p for p in members if str(level + 1) in p.skip_stages.split(",")]
    for p in skipping:
        at[p.name] = level + 1
    return [p for p in members if p not in skipping]


class ShardStages:
    """The stages of the shards a runner renders: their renderers, built once per (model, stage), and
    their intermediates in the store.  ``on_images(label, n)``: images a stage (or generate) made (the
    worker's metrics); what each stage made and spent goes to the shard's ledger by :meth:`run`'s
    ``on_stage``."""

    def __init__(
        self,
        store: Store,
        factory: StageFactory,
        on_images: Callable[[str, int], None] | None = None,
        batch_sizes: BatchSizes | None = None,
    ):
        self.store = store
        self.factory = factory
        self.on_images = on_images or (lambda label, n: None)
        # Each stage's calls per batch (worker/render/batchsize.py): the worker's, shared with generate; else whole batches.
        self.batch_sizes = batch_sizes or BatchSizes(None, fixed=WHOLE_BATCH)
        self._built: dict[tuple[int, Stage], Any] = {}  # a renderer, or the JobError its build raised
        self._for: object = None  # the renderer the built stages share a model with

    def clear(self) -> None:
        """Let go of every stage's renderer: the job's model is about to be freed, and a refine with it
        shares its components (kept here, they would hold the old model on the card)."""
        self._built.clear()
        self._for = None

    def renderer(self, base: object, index: int, stage: Stage) -> Any:
        """Stage ``index``'s renderer (built on first use; built anew once the job's model changed)."""
        if base is not self._for:
            self._built.clear()
            self._for = base
        key = (index, stage)
        if key not in self._built:
            try:
                self._built[key] = self.factory(stage, index)
            except JobError as exc:
                # Kept as the stage's answer while the job's model stays: a model that will not load is not
                # loaded again for every prompt asked whether it takes latents, nor for every batch.
                self._built[key] = exc
        built = self._built[key]
        if isinstance(built, JobError):
            raise built
        return built

    def levels(self, msg: ShardMessage) -> dict[str, int]:
        """Each of the shard's prompts that a stage image is stored for: the highest level stored.
        One listing of the shard's own prefix."""
        found: dict[str, int] = {}
        prefix = spec.stage_prefix(msg.job, msg.shard, msg.life)
        for key in self.store.list(prefix):
            level_text, _, file = key[len(prefix) :].partition("/")
            name = file.removesuffix(spec.STAGE_IMAGE_EXT).removesuffix(spec.STAGE_LATENTS_EXT)
            if level_text.isdigit() and name and name != file:
                found[name] = max(found.get(name, -1), int(level_text))
        return found

    def load(self, msg: ShardMessage, name: str, level: int) -> Any | None:
        """A prompt's stored level (latents where they were stored so, else the image), None if gone:
        taken up as the level an earlier delivery left, as if it had just been made."""
        prompt = next((p for p in msg.prompts if p.name == name), None)
        size = final_size(msg.params.stages[:level], prompt.width, prompt.height) if prompt else None
        for latents in (True, False) if level_may_be_latents(msg.params.stages, level) else (False,):
            key = spec.stage_key(msg.job, msg.shard, level, name, msg.life, latents=latents)
            data = read_record(self.store, key, MAX_IMAGE_BYTES)  # over it: absent, rendered again
            if data:
                return decode_level(data, latents, size, key)  # not a level: absent, rendered again
        return None

    def hands_latents(self, msg: ShardMessage, base: object, prompt: Prompt, maker: int) -> bool:
        """Whether what stage ``maker`` (-1: generate) makes of ``prompt`` goes on as latents: to the next
        stage it does not skip, by ``renderfleet.stages.hands_latents`` on the two models' families (the
        stage's renderer built here if it is not yet: its model is needed next anyway)."""
        stages = msg.params.stages
        taker = next_stage(stages, prompt.skip_stages, maker)
        if taker is None:
            return False
        maker_stage = stages[maker] if maker >= 0 else None
        if not kinds_hand_latents(maker_stage, stages[taker]):  # no model need be asked
            return False
        return hands_latents(maker_stage, stages[taker], self._family(msg, base, maker), self._family(msg, base, taker))

    def _family(self, msg: ShardMessage, base: object, index: int) -> str:
        """The family name of the pipeline generate (-1) or stage ``index`` runs ('' where none is known)."""
        if index < 0:
            runs: Any = base
        else:
            try:
                runs = self.renderer(base, index, msg.params.stages[index])
            except ModelLoadError:  # the job's, as a whole: before generate spends anything on it
                raise
            except JobError:  # run() says why, as the stage's failure
                return ""
        return str(getattr(getattr(runs, "family", None), "name", "") or "")

    def run(
        self,
        msg: ShardMessage,
        base: object,
        prompts: Sequence[Prompt],
        images: dict[str, Any],
        resumed: dict[str, int],
        failures: list[Failure],
        should_stop: Callable[[], bool],
        on_stage: StageHook | None = None,
        uploads: Executor | None = None,
        life_ended: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """Take each prompt's image through the stages it has not been through: ``images`` holds the
        images just generated (level 0) and those taken from the store at level ``resumed[name]``.
        The final images by name.  Each level reached below the last is stored before the next
        stage begins, unless it came from there.  A stage's failure is its prompts' (``failures``).
        ``on_stage(label, n, seconds)``: what each stage made and the seconds its calls took (not its
        renderer's build nor the store's writes), for the shard's ledger (the job's stage figures).
        A stage's model that will not load raises :class:`ModelLoadError`: the job's failure, as a whole.
        ``uploads``: the runner's upload threads, which encode and write a level's images side by side.
        ``life_ended``: whether the job's life this shard was leased in is over (the ledger's), asked after
        each level is written: a level written across a ``delete`` or a new life is withdrawn by its writer,
        and the shard stops (:class:`Reclaimed`, fenced)."""
        stages = msg.params.stages
        # A segment before the job's last (its next stage on a pool of its own) stops at its level and stores it.
        last = len(stages) if msg.until < 0 else msg.until
        # Generate's 8-bit pixels made PIL: a stage, and a level stored between stages, takes PIL images.
        current = {name: outputs.to_pil(image) for name, image in images.items()}
        at = {name: resumed.get(name, 0) for name in current}
        for level in range(last):
            members = _level_members(prompts, current, at, level)
            if not members:
                continue
            self._store(msg, level, [p for p in members if resumed.get(p.name) != level], current, uploads, life_ended)
            failpoints.reach("stage")
            self._run_level(msg, base, level, members, current, at, failures, should_stop, on_stage)
        done = {p.name: current[p.name] for p in prompts if p.name in current and at.get(p.name, 0) == last}
        if msg.until >= 0:
            stored = [p for p in prompts if p.name in done and resumed.get(p.name) != last]
            self._store(msg, last, stored, current, uploads, life_ended)
        return done

    def _run_level(
        self,
        msg: ShardMessage,
        base: object,
        level: int,
        members: list[Prompt],
        current: dict[str, Any],
        at: dict[str, int],
        failures: list[Failure],
        should_stop: Callable[[], bool],
        on_stage: StageHook | None,
    ) -> None:
        """Stage ``level`` over ``members``: what it makes of each goes on to the next level in ``current`` (``at``:
        each prompt's level); a prompt it fails drops out (its failure in ``failures``)."""
        stages = msg.params.stages
        try:
            renderer = self.renderer(base, level, stages[level])
        except ModelLoadError:
            # The stage's model will not load: the same on every worker, so the job fails once, as a
            # whole, as for its own model (renderfleet/jobfailure.py), not each prompt three times.
            raise
        except JobError as exc:  # the stage cannot refine these settings: its prompts', not the worker's
            failures.extend((p, str(exc), False) for p in members)
            for p in members:
                current.pop(p.name)
            return
        latents = {p.name for p in members if self.hands_latents(msg, base, p, level)}
        began = time.monotonic()
        made = self._run_stage(renderer, members, current, latents, failures, should_stop)
        seconds = time.monotonic() - began
        for p in members:
            if p.name in made:
                current[p.name] = made[p.name]
                at[p.name] = level + 1
            else:
                current.pop(p.name, None)
        self.on_images(stage_label(stages, level + 1), len(made))
        if on_stage is not None and made:
            on_stage(stage_label(stages, level + 1), len(made), seconds)

    def _store(
        self,
        msg: ShardMessage,
        level: int,
        members: Sequence[Prompt],
        current: dict[str, Any],
        uploads: Executor | None = None,
        life_ended: Callable[[], bool] | None = None,
    ) -> None:
        """The level's images in the store, before the stage that takes them runs: a worker lost in it
        leaves them for the next delivery.  An image already stored at this level is the same bytes
        (the level's key is under the job's life, and a redelivery renders the same bytes), so each is
        written only where no object is (``put_new``), and what this call put in place is known by tag.
        Encoded and written side by side in ``uploads`` where given (zlib and the store's I/O let the
        threads run together), as the runner writes a batch's final images.

        Then the life is asked (``life_ended``): a level whose writes straddled a ``delete`` (the sweep
        ran before a slow write landed) or a new life of the name is removed by its writer, each object
        only if it is still the one it wrote, and the shard stops fenced: nothing of an ended life stays
        in a deleted name's folder (docs/design.md "Writes of an ended life")."""
        if not members:
            return
        failpoints.reach("before-stage-level")
        written: dict[str, str] = {}

        def put(p: Prompt) -> None:
            latents = is_latents(current[p.name])
            key = spec.stage_key(msg.job, msg.shard, level, p.name, msg.life, latents=latents)
            data = encode_intermediate(current[p.name])
            tag = self.store.put_new(key, data, content_type="application/octet-stream" if latents else "image/png")
            if tag is not None:
                written[key] = tag

        try:
            if uploads is None or len(members) < 2:
                for p in members:
                    put(p)
            else:
                for future in [uploads.submit(put, p) for p in members]:
                    future.result()  # every one stored before the stage runs; the first error raised
        finally:
            if written and life_ended is not None and life_ended():
                self._withdraw(msg, level, written)
                raise Reclaimed(f"job {msg.job}'s life ended while level {level} of its stages was written", fenced=True)

    def _withdraw(self, msg: ShardMessage, level: int, written: dict[str, str]) -> None:
        """Remove the objects of a level written after its job's life ended (each only if still ours)."""
        removed = withdraw(self.store, written, msg.job)
        log.warning(
            "job %s: its life ended while level %d of its stages was written: withdrew %d of its %d objects",
            msg.job,
            level,
            removed,
            len(written),
        )

    def _run_stage(
        self,
        renderer: Any,
        members: list[Prompt],
        current: dict[str, Any],
        latents: set[str],
        failures: list[Failure],
        should_stop: Callable[[], bool],
    ) -> dict[str, Any]:
        """One stage over ``members``: a call per group of inputs that can share one (one size, images or
        latents, and latents out for the prompts in ``latents``), each group in calls of the stage's own
        size (``BatchSizes.stage_size_for``), halved on out-of-memory down to one prompt a call; a failing
        call split to find the prompt at fault."""
        groups: dict[tuple[Any, bool], list[Prompt]] = {}
        for p in members:
            groups.setdefault((shape_of(current[p.name]), p.name in latents), []).append(p)
        made: dict[str, Any] = {}
        for (_, out_latents), group in groups.items():
            self._run_group(renderer, group, current, "latent" if out_latents else "pil", made, failures, should_stop)
        return made

    def _run_group(
        self,
        renderer: Any,
        group: list[Prompt],
        current: dict[str, Any],
        output: str,
        made: dict[str, Any],
        failures: list[Failure],
        should_stop: Callable[[], bool],
    ) -> None:
        sample = current[group[0].name]
        extra = {"output": output} if output != "pil" else {}  # a renderer that makes images only takes none
        size = self.batch_sizes.stage_size_for(renderer, group[0], sample, len(group), should_stop, output)
        pending = [group[i : i + size] for i in range(0, len(group), size)]
        while pending:
            chunk = pending.pop(0)
            try:
                out = renderer.run([current[p.name] for p in chunk], chunk, should_stop=should_stop, **extra)
            except OutOfMemory as exc:
                if len(chunk) > 1:
                    # This stage's size halved (remembered), the rest of the group cut again at it.
                    size = self.batch_sizes.stage_out_of_memory(renderer, sample, len(chunk))
                    rest = [p for c in [chunk, *pending] for p in c]
                    pending = [rest[i : i + size] for i in range(0, len(rest), size)]
                    continue
                failures.append((chunk[0], f"out of memory at batch size 1 in a stage: {exc}", True))
                continue
            except JobError as exc:
                failures.extend((p, str(exc), False) for p in chunk)
                continue
            except PermanentError as exc:
                if len(chunk) > 1:
                    pending[:0] = [[p] for p in chunk]
                    continue
                failures.append((chunk[0], str(exc), not isinstance(exc, PromptError)))
                continue
            for p, image in zip(chunk, out, strict=True):
                made[p.name] = image

    def forget(self, msg: ShardMessage, names: Sequence[str]) -> None:
        """Delete the intermediates of prompts whose final image is stored (a missing one is no error)."""
        stages = msg.params.stages
        for name in names:
            for level in range(len(stages)):
                for latents in (False, True) if level_may_be_latents(stages, level) else (False,):
                    try:
                        self.store.delete(spec.stage_key(msg.job, msg.shard, level, name, msg.life, latents=latents))
                    except Exception as exc:  # a leftover costs storage, never an image
                        log.warning("stage image %s of job %s not deleted: %s", name, msg.job, exc)
