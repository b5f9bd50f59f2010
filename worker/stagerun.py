"""A shard's stages after generate, run per batch and checkpointed per stage (issue 39).

The shard runner (worker/runner.py) generates a batch's images as always; when the job has stages
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

Every stage draws its noise from the prompt's seed and the stage's position
(``renderfleet.stages.stage_seed``), and PNG keeps every pixel, so an image taken back from the
store is the image that was stored: a redelivered shard comes out byte-identical.  Levels: 0 is
the generated image, ``k`` the image after stage ``k`` (1-based); the last level is never stored
here.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from renderfleet import failpoints, spec
from renderfleet.errors import JobError, OutOfMemory, PermanentError, PromptError
from renderfleet.spec import Prompt, ShardMessage
from renderfleet.stages import Stage
from renderfleet.store import Store

log = logging.getLogger("renderfleet.runner")

StageFactory = Callable[[Stage, int], Any]  # (stage, its index from 0) -> a worker.stages.StageRenderer
StageHook = Callable[[str, int, float], None]  # (stage_label, images made, seconds its calls took)
Failure = tuple[Prompt, str, bool]  # (prompt, reason, the node's fault?)


def stage_label(stages: Sequence[Stage], level: int) -> str:
    """What made the images of ``level``: ``generate``, or ``upscale-1``, ``refine-2`` (kind and position)."""
    return "generate" if level == 0 else f"{stages[level - 1].kind}-{level}"


def encode_intermediate(image: Any) -> bytes:
    """An image between stages as lossless PNG, with nothing but its pixels (no clock, no text)."""
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def decode_intermediate(data: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB").copy()


class ShardStages:
    """The stages of the shards a runner renders: their renderers, built once per (model, stage), and
    their intermediates in the store.  ``on_images(label, n)``: images a stage (or generate) made (the
    worker's metrics); what each stage made and spent goes to the shard's ledger by :meth:`run`'s
    ``on_stage``."""

    def __init__(self, store: Store, factory: StageFactory, on_images: Callable[[str, int], None] | None = None):
        self.store = store
        self.factory = factory
        self.on_images = on_images or (lambda label, n: None)
        self._built: dict[tuple[int, Stage], Any] = {}
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
            self._built[key] = self.factory(stage, index)
        return self._built[key]

    def levels(self, msg: ShardMessage) -> dict[str, int]:
        """Each of the shard's prompts that a stage image is stored for: the highest level stored.
        One listing of the shard's own prefix."""
        found: dict[str, int] = {}
        prefix = spec.stage_prefix(msg.job, msg.shard, msg.life)
        for key in self.store.list(prefix):
            level_text, _, file = key[len(prefix) :].partition("/")
            name = file.removesuffix(".png")
            if level_text.isdigit() and name:
                found[name] = max(found.get(name, -1), int(level_text))
        return found

    def load(self, msg: ShardMessage, name: str, level: int) -> Any | None:
        data = self.store.get(spec.stage_key(msg.job, msg.shard, level, name, msg.life))
        return decode_intermediate(data) if data else None

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
    ) -> dict[str, Any]:
        """Take each prompt's image through the stages it has not been through: ``images`` holds the
        images just generated (level 0) and those taken from the store at level ``resumed[name]``.
        The final images by name.  Each level reached below the last is stored before the next
        stage begins, unless it came from there.  A stage's failure is its prompts' (``failures``).
        ``on_stage(label, n, seconds)``: what each stage made and the seconds its calls took (not its
        renderer's build nor the store's writes), for the shard's ledger (the job's stage figures).
        ``uploads``: the runner's upload threads, which encode and write a level's images side by side."""
        stages = msg.params.stages
        # A segment before the job's last (its next stage on a pool of its own) stops at its level and stores it.
        last = len(stages) if msg.until < 0 else msg.until
        current = dict(images)
        at = {name: resumed.get(name, 0) for name in current}
        for level in range(last):
            members = [p for p in prompts if p.name in current and at.get(p.name, 0) == level]
            # A prompt that skips this stage (its skip_stages) goes to the next level as it is.
            skipping = [p for p in members if str(level + 1) in p.skip_stages.split(",")]
            for p in skipping:
                at[p.name] = level + 1
            members = [p for p in members if p not in skipping]
            if not members:
                continue
            self._store(msg, level, [p for p in members if resumed.get(p.name) != level], current, uploads)
            failpoints.reach("stage")
            try:
                renderer = self.renderer(base, level, stages[level])
            except JobError as exc:  # the stage's model will not load, or cannot refine: its prompts', not the worker's
                failures.extend((p, str(exc), False) for p in members)
                for p in members:
                    current.pop(p.name)
                continue
            began = time.monotonic()
            made = self._run_stage(renderer, members, current, failures, should_stop)
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
        done = {p.name: current[p.name] for p in prompts if p.name in current and at.get(p.name, 0) == last}
        if msg.until >= 0:
            self._store(msg, last, [p for p in prompts if p.name in done and resumed.get(p.name) != last], current, uploads)
        return done

    def _store(
        self,
        msg: ShardMessage,
        level: int,
        members: Sequence[Prompt],
        current: dict[str, Any],
        uploads: Executor | None = None,
    ) -> None:
        """The level's images in the store, before the stage that takes them runs: a worker lost in it
        leaves them for the next delivery.  An image already stored at this level is the same bytes.
        Encoded and written side by side in ``uploads`` where given (zlib and the store's I/O let the
        threads run together), as the runner writes a batch's final images."""

        def put(p: Prompt) -> None:
            self.store.put(
                spec.stage_key(msg.job, msg.shard, level, p.name, msg.life),
                encode_intermediate(current[p.name]),
                content_type="image/png",
            )

        if uploads is None or len(members) < 2:
            for p in members:
                put(p)
            return
        for future in [uploads.submit(put, p) for p in members]:
            future.result()  # every one stored before the stage runs; the first error raised

    def _run_stage(
        self,
        renderer: Any,
        members: list[Prompt],
        current: dict[str, Any],
        failures: list[Failure],
        should_stop: Callable[[], bool],
    ) -> dict[str, Any]:
        """One stage over ``members``: the whole batch in one call, halved on out-of-memory down to one
        prompt a call; a failing call split to find the prompt at fault."""
        made: dict[str, Any] = {}
        pending = [members]
        while pending:
            chunk = pending.pop(0)
            try:
                out = renderer.run([current[p.name] for p in chunk], chunk, should_stop=should_stop)
            except OutOfMemory as exc:
                if len(chunk) > 1:
                    half = len(chunk) // 2
                    pending[:0] = [chunk[:half], chunk[half:]]
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
        return made

    def forget(self, msg: ShardMessage, names: Sequence[str]) -> None:
        """Delete the intermediates of prompts whose final image is stored (a missing one is no error)."""
        for name in names:
            for level in range(len(msg.params.stages)):
                try:
                    self.store.delete(spec.stage_key(msg.job, msg.shard, level, name, msg.life))
                except Exception as exc:  # a leftover costs storage, never an image
                    log.warning("stage image %s of job %s not deleted: %s", name, msg.job, exc)
