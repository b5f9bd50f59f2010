"""Rendering one batch of prompts into image bytes (PNG, WebP or JPEG: the job's format).

:class:`Renderer` wraps a loaded pipeline and knows nothing of queues or
stores: prompts in, one image per prompt out, in order, and each encoded as a
PNG apart (the runner encodes while the next batch renders).  It is the part of the
path that turns a batch into images (shard -> batch -> **render** -> store).

Every image depends on its prompt's fields and seed alone: each prompt gets
its own CPU generator, so its starting latents are the same on every device
and at every position in a batch, and the encoding carries no clock.

A prompt's scheduler is switched on the loaded pipeline, never by loading the
model again (:class:`SchedulerCache`); a prompt longer than the text encoder's
77 tokens is embedded in 77-token chunks (``worker.render.prompts``) unless its job
says ``long_prompts=truncate``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from renderfleet import __version__, failpoints, images, renderconfig, samplers
from renderfleet.errors import BadOutput, JobError, OutOfMemory, PermanentError, PromptError, Reclaimed
from renderfleet.renderconfig import RenderConfig
from renderfleet.spec import BENCH_PREFIX, FIELD, INT_LIMITS, Prompt, field_problem
from worker.accounting.metrics import BadImages
from worker.render import outputs
from worker.render.deviceerrors import call_failure, first_line
from worker.render.loras import LoraCache
from worker.render.models import LoadedModel, set_vae_memory_modes, vae_memory_modes
from worker.render.models.cuda import attention_kernels
from worker.render.models.families import PipelineFamily, family_of
from worker.render.pinning import config_of
from worker.render.prompts import LongPrompts, quiet_truncation

if TYPE_CHECKING:
    from worker.render.compiled import CompileCache

PNG_COMPRESS_LEVEL = images.PNG_COMPRESS_LEVEL

log = logging.getLogger(__name__)


class SchedulerCache:
    """The schedulers a pipeline's jobs ask for, by name, built once each from the pipeline's own.

    Each is made with ``from_config`` of the scheduler the model came with, so the
    model's betas, prediction type and timestep spacing stay; only the solver and the
    options its name implies (``renderfleet.samplers``, of the family's kind: noise
    prediction or flow matching) change.  Setting ``pipe.scheduler`` is all a switch
    costs: the model is never loaded again.  The name '' is the pipeline's own
    scheduler, as loaded.
    """

    def __init__(self, pipe: Any, family: PipelineFamily | None = None) -> None:
        self.pipe = pipe
        self.family = family or family_of(pipe)
        self.default: Any = getattr(pipe, "scheduler", None)
        self._built: dict[str, Any] = {"": self.default}

    def get(self, name: str) -> Any:
        """The scheduler called ``name``; JobError if this pipeline cannot use it."""
        if name not in self._built:
            if why := samplers.scheduler_problem(name):
                raise JobError(why)
            cls_name, options = self.family.scheduler(name)
            import diffusers

            cls = getattr(diffusers, cls_name)
            if options.get("use_flow_sigmas") and "shift" in self.default.config:
                # A flow-matching model's shift is its scheduler's: the multistep solvers call it flow_shift.
                options.setdefault("flow_shift", float(self.default.config["shift"]))
            try:
                self._built[name] = cls.from_config(self.default.config, **options)
            except (ImportError, ValueError, TypeError) as exc:
                raise JobError(f"scheduler {name!r} ({cls_name}) cannot drive this model: {exc}") from exc
        return self._built[name]

    def use(self, name: str, seeds: Sequence[int]) -> None:
        """Make ``name`` the pipeline's scheduler for its next call, of prompts with ``seeds``.

        A scheduler that draws noise from a generator of its own (DPM++ SDE's Brownian
        tree) is seeded with the prompts' seeds, one tree each: left to itself it seeds
        from the clock, and a redelivered batch would not render the same bytes.
        """
        scheduler = self.pipe.scheduler = self.get(name)
        if hasattr(scheduler, "noise_sampler_seed"):
            scheduler.noise_sampler_seed = list(seeds)


class Renderer:
    """Renders batches of prompts that share a render key.

    By default one pipeline call renders the whole batch: batch size is the
    biggest lever on cost per image.  Batching is not bit-exact across batch
    *compositions*: GEMM and convolution kernels block their work by batch
    size, so the same row comes out a few ULPs apart in a batch of 1, 2 or 4,
    and after rounding to 8 bits some pixels differ.  The shard runner makes
    that harmless by fixing each batch's members by position in the shard
    (``ShardMessage.batches``), so a redelivered batch has the same
    composition and re-renders the same bytes.  ``batch_invariant=True``
    renders each prompt with its own call instead, so an image's bytes depend
    on its prompt alone (half the throughput on CPU, more lost on a GPU): for
    users who need identical images across batch sizes or after OOM halving.

    After each call, ``last_batch_seconds`` is its wall time.

    On CUDA each call switches the VAE's slicing and tiling to what its size
    and batch need (``worker.render.models.vae_memory_modes``) and each batch starts
    the card's memory peak afresh (:func:`reset_peak_memory`); with a compiled
    UNet, ``compile_cache`` loads the fleet's signed compile cache before the
    first call at a size and, after a call that compiled something, hands what
    this worker compiled to its background uploader.

    An image that is not one (NaN or inf values, all black: ``worker.render.outputs``) is
    never returned: its prompts are rendered once more with the VAE in float32, and if
    they are still bad :class:`BadOutput` (a device error) is raised.  ``on_bad_images``
    hears how many were rendered again and how many refused (the worker's metric).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        batch_invariant: bool = False,
        compile_cache: CompileCache | None = None,
        loras: LoraCache | None = None,
        on_bad_images: Callable[[BadImages, int], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self.on_bad_images = on_bad_images
        self.batch_invariant = batch_invariant
        self.compile_cache = compile_cache
        self.last_batch_seconds = 0.0
        self.family = family_of(loaded.pipe)
        self.schedulers = SchedulerCache(loaded.pipe, self.family)
        self.loras = loras or LoraCache(loaded.pipe)
        # CLIP-only families embed long prompts in chunks; T5 families read them whole (up to its length).
        self.long_prompts = LongPrompts(loaded.pipe) if self.family.family.chunks else None
        if self.long_prompts is None:
            quiet_truncation(loaded.pipe, self.family.family.t5_tokens)

    def render(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[bytes]:
        """One image file per prompt, in order: :meth:`render_images`, then :meth:`encode` each."""
        images = self.render_images(prompts, should_stop=should_stop)
        return [self.encode(image, p) for image, p in zip(images, prompts, strict=True)]

    def render_images(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
        output_type: str = "pil",
    ) -> list[Any]:
        """One image per prompt, in order: its 8-bit pixels on the host (``worker.render.outputs.Pixels``; PIL only
        from a pipeline without diffusers' image processor), made PIL where :meth:`encode` encodes them (the
        shard runner's encode pool, while the next batch renders);
        ``output_type="latent"``: the latents, one tensor each, not decoded (for a refine that takes them:
        ``renderfleet.stages.hands_latents``).

        ``should_stop`` is asked before starting and after every denoising
        step, the last one included; once it says yes, the remaining steps and
        the decode are skipped and :class:`Reclaimed` is raised instead of
        returning images.  It says yes only when the batch cannot finish in
        time (``worker.node.stop.StopSignal.can_finish``), and the decode is part of
        finishing: at a large size on a CPU it can take longer than many steps.

        Raises ``ValueError`` for prompts that cannot share a call,
        :class:`OutOfMemory` when the accelerator runs out of memory (halve
        the batch and retry), :class:`DeviceError` when the accelerator itself
        failed (:func:`is_device_error`) or gave images that are not images
        (:class:`BadOutput`), :class:`JobError` when the pipeline refuses the
        settings, :class:`PermanentError` for any other failure.
        """
        # 1. Check the inputs, and that the model's family can honour them (the job's error if not).
        check_inputs(prompts)
        self.family.check(prompts)

        # 2. Stop before starting if asked to.
        if should_stop():
            raise Reclaimed("stopped before the batch started")

        # 3. The job's LoRAs, before any text is embedded: a LoRA may change the text encoder.
        self.loras.use(prompts[0].loras)

        # 4. Long prompts: embedded in 77-token chunks, a call per chunk count (prompts within
        #    the limit go as text, as they always did); None: none is long, or cut at 77.
        embeds = (self.long_prompts and self.long_prompts.embed(prompts)) or [None] * len(prompts)

        # 5. Denoise and decode: per prompt, or a call per group of prompts whose text
        #    has the same length in chunks (the batch in one call, unless long prompts split it).
        groups = self._call_groups(prompts, embeds)
        reset_peak_memory(str(getattr(self.loaded, "device", "cpu")))
        started = time.perf_counter()
        try:
            out = self._render_groups(prompts, groups, embeds, should_stop, output_type)
        finally:
            self.last_batch_seconds = time.perf_counter() - started

        # 6. One image per prompt.
        return out

    def _call_groups(self, prompts: Sequence[Prompt], embeds: Sequence[Any]) -> list[list[int]]:
        """The prompts' positions a pipeline call each renders: one a call where batches must not change
        an image (``batch_invariant``), else one per chunk count and per the family's own split."""
        if self.batch_invariant:
            return [[i] for i in range(len(prompts))]
        # A call per chunk count, and per the family's own split (FLUX: true CFG for the prompts with a
        # negative one only, so a prompt's image never depends on its neighbours' settings).
        by_kind: dict[tuple[int, Any], list[int]] = {}
        for i in range(len(prompts)):
            embedded = embeds[i]
            key = (embedded.chunks if embedded else 0, self.family.call_group(prompts[i]))
            by_kind.setdefault(key, []).append(i)
        return list(by_kind.values())

    def _render_groups(
        self,
        prompts: Sequence[Prompt],
        groups: list[list[int]],
        embeds: Sequence[Any],
        should_stop: Callable[[], bool],
        output_type: str,
    ) -> list[Any]:
        """A call per group, in order (the stop asked between them): each prompt's image at its position."""
        out: list[Any] = [None] * len(prompts)
        for n, group in enumerate(groups):
            if n > 0 and should_stop():
                raise Reclaimed("stopped mid-batch")
            chunked = [e for i in group if (e := embeds[i]) is not None]
            rendered = self._call_checked([prompts[i] for i in group], should_stop, chunked or None, output_type)
            if len(rendered) != len(group):
                raise PermanentError(f"pipeline returned {len(rendered)} images for {len(group)} prompts")
            for i, image in zip(group, rendered, strict=True):
                out[i] = image
        return out

    def encode(self, image: Any, prompt: Prompt, *, extra: dict[str, str] | None = None) -> bytes:
        """The image's file in the prompt's format, with what made it (``extra``: what the runner adds,
        the job's stages); :class:`PromptError` if its text cannot be carried."""
        used: dict[str, str | None] = {**self.family.used(prompt), **(extra or {})}
        quantize = getattr(self.loaded, "quantize", "none")
        if quantize != "none":  # 8-bit weights render other bytes: said in every image
            used = {**used, "quantize": quantize}
        # The configuration it was rendered under (renderfleet/renderconfig.py): a job's images never mix two.
        used[renderconfig.FIELD] = self.config.digest
        return encode_image(image, prompt, self.loaded.model, used)

    @property
    def config(self) -> RenderConfig:
        """The render configuration of this renderer (worker/render/pinning.py), as it is now (torch's threads
        are this process's setting of the moment)."""
        return config_of(self)

    def generate(
        self, prompts: Sequence[Prompt], *, output_type: str = "pil", should_stop: Callable[[], bool] = lambda: False
    ) -> list[Any]:
        """One pipeline call's images, not encoded: what a probe of the accelerator's
        memory or a benchmark of its speed renders (``output_type="pt"``: tensors, no PIL)."""
        check_inputs(prompts)
        self.family.check(prompts)
        started = time.perf_counter()
        try:
            return self._call(list(prompts), should_stop, output_type=output_type)
        finally:
            self.last_batch_seconds = time.perf_counter() - started

    def _call_checked(
        self, prompts: list[Prompt], should_stop: Callable[[], bool], embeds: list[Any] | None, output_type: str = "pil"
    ) -> list[Any]:
        """:meth:`_call`'s images, none of them bad: a bad one's prompts rendered once more with
        the VAE in float32 (on a CPU, where it is, simply once more); still bad, :class:`BadOutput`.
        Latents as they come: no VAE decoded them (the stage that takes them checks its images)."""
        if output_type == "latent":
            return self._call(prompts, should_stop, output_type=output_type, embeds=embeds)
        images = self._call(prompts, should_stop, embeds=embeds)
        bad = getattr(images, "bad", None)
        if not bad:
            return list(images)
        again = sorted(bad)
        names = ", ".join(prompts[i].name for i in again)
        with outputs.vae_in_float32(self.loaded.pipe) as upcast:
            rendered = self._call(
                [prompts[i] for i in again], should_stop, embeds=[embeds[i] for i in again] if embeds else None
            )
        how = "with the VAE upcast to float32" if upcast else "as it was (its VAE is in float32 already)"
        if still := getattr(rendered, "bad", None):
            if self.on_bad_images:
                self.on_bad_images(BadImages.REFUSED, len(still))
            why = "; ".join(f"{prompts[again[j]].name}: {reason}" for j, reason in sorted(still.items()))
            raise BadOutput(f"images that are not images, rendered again {how} and still bad ({why}): none stored")
        log.warning("prompts %s: %s; rendered again %s, now good", names, ", ".join(sorted(set(bad.values()))), how)
        if self.on_bad_images:
            self.on_bad_images(BadImages.RERENDERED, len(again))
        out = list(images)
        for i, image in zip(again, rendered, strict=True):
            out[i] = image
        return out

    def _call(
        self,
        prompts: list[Prompt],
        should_stop: Callable[[], bool],
        output_type: str = "pil",
        embeds: list[Any] | None = None,
    ) -> list[Any]:
        """One pipeline call: its images, or :class:`Reclaimed` if stopped.  ``embeds``: the
        prompts' chunked embeddings (``worker.render.prompts.Embedded``), in place of their text.
        Images asked as PIL come checked, as 8-bit pixels (``worker.render.outputs.Checked``: ``bad`` names any
        that is not one)."""
        steps, _guidance, width, height, scheduler = prompts[0].render_key  # guidance: the family's call_kwargs
        device = str(getattr(self.loaded, "device", "cpu"))
        text = self._prepare_call(prompts, embeds, scheduler, device, width, height)
        # For PIL images the pipeline's pixel tensor, checked and made 8-bit on its device (worker.render.outputs).
        wanted, output_type = output_type, outputs.ask_for(self.loaded.pipe, output_type)
        output = self._pipe_call(prompts, text, should_stop, output_type, device, steps, width, height)
        if self.compile_cache is not None:
            self.compile_cache.after(width, height, len(prompts))
        if wanted == "pil":
            return outputs.check(self.loaded.pipe, output)
        return list(output.images)

    def _prepare_call(
        self, prompts: list[Prompt], embeds: list[Any] | None, scheduler: str, device: str, width: int, height: int
    ) -> dict[str, Any]:
        """Set the pipeline up for one call (its scheduler, the job's LoRAs, the VAE's memory modes on CUDA, the
        compile cache at this size); the call's text arguments: the prompts' text, or their chunked embeddings."""
        self.schedulers.use(scheduler, [p.seed for p in prompts])
        # The job's adapters, set before every call from its settings: a call never inherits the last job's
        # (a no-op after render_images set them, as it must before embedding long prompts).
        self.loras.use(prompts[0].loras)
        text: dict[str, Any] = (
            self.family.text_kwargs(prompts)
            if embeds is None or self.long_prompts is None
            else self.long_prompts.call_kwargs(embeds)
        )
        if device.startswith("cuda"):  # the CPU path stays as it was
            set_vae_memory_modes(self.loaded.pipe, *vae_memory_modes(device, width, height, len(prompts)))
        if self.compile_cache is not None:
            self.compile_cache.before(width, height)
        return text

    def _pipe_call(
        self,
        prompts: list[Prompt],
        text: dict[str, Any],
        should_stop: Callable[[], bool],
        output_type: str,
        device: str,
        steps: int,
        width: int,
        height: int,
    ) -> Any:
        """The pipeline called once, as it gives its output; :class:`OutOfMemory` (the card's cached memory handed
        back first) or the failure :func:`call_failure` names when it fails."""
        import torch

        on_step_end = _stop_between_steps(should_stop)
        out_of_memory = ""
        try:
            failpoints.reach("render")
            with torch.inference_mode(), attention_kernels(getattr(self.loaded, "attention", "auto")):
                output = self.loaded.pipe(
                    **self.family.prune(
                        {
                            **text,
                            **self.family.call_kwargs(prompts),
                            "num_inference_steps": steps,
                            "width": width,
                            "height": height,
                            # CPU generators: the same starting latents on every device.
                            "generator": [torch.Generator("cpu").manual_seed(p.seed) for p in prompts],
                            "output_type": output_type,
                            "callback_on_step_end": on_step_end,
                        }
                    )
                )
        except Exception as exc:
            if (failure := call_failure(exc)) is not None:
                raise failure from exc
            # Only its text leaves this block: the exception's traceback holds the failed
            # call's frames, and they its activations, until the block ends.
            out_of_memory = first_line(exc)
        if out_of_memory:
            # The exception and its frames are gone now, so what they held is free to hand back.
            release_cached_memory(device)
            raise OutOfMemory(f"out of memory rendering {len(prompts)} prompts at {width}x{height}: {out_of_memory}")
        return output


def _stop_between_steps(should_stop: Callable[[], bool]) -> Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]:
    """A pipeline's ``callback_on_step_end`` that raises :class:`Reclaimed` once ``should_stop`` says so."""

    def on_step_end(pipeline: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        # Before the stop is asked: a step a test slows here (sleep) still ends at the stop told during it.
        failpoints.reach("step")
        if should_stop():
            # Raised, not diffusers' interrupt flag: with the flag the loop skips its remaining
            # steps but still decodes the half-denoised latents we would throw away, and at a
            # large size on a CPU a decode costs more than a step: a worker told to stop overran
            # its grace.  Reclaimed is a BaseException: the except around the call (Renderer._pipe_call) lets
            # it through.
            raise Reclaimed("stopped mid-batch")
        return callback_kwargs

    return on_step_end


def check_inputs(prompts: Sequence[Prompt]) -> None:
    """Raise ``ValueError`` naming the bad value if ``prompts`` cannot share a call."""
    if not prompts:
        raise ValueError("`prompts` must hold at least one prompt, but it is empty")
    key = prompts[0].render_key
    for p in prompts[1:]:
        if p.loras != prompts[0].loras:
            raise ValueError(
                f"all prompts in a batch must share their LoRAs; prompt {p.name!r} has {p.loras} "
                f"but prompt {prompts[0].name!r} has {prompts[0].loras}"
            )
        if p.render_key != key:
            raise ValueError(
                f"all prompts in a batch must share (steps, guidance, width, height, scheduler); "
                f"prompt {p.name!r} has {p.render_key} but prompt {prompts[0].name!r} has {key}"
            )
    # The ranges are the table submit checks (spec.FIELDS); the words are diffusers'.
    steps, guidance, width, height, scheduler = key
    if field_problem(FIELD["steps"], steps):
        raise ValueError(f"`steps` has to be a positive integer up to {INT_LIMITS['steps'][1]} but is {steps}")
    if field_problem(FIELD["width"], width) or field_problem(FIELD["height"], height):
        raise ValueError(
            f"`width` and `height` have to be positive multiples of 8 up to {INT_LIMITS['width'][1]} "
            f"but are {width} and {height}"
        )
    if why := field_problem(FIELD["guidance"], guidance):
        raise ValueError(f"`guidance_scale`: {why}")
    if why := field_problem(FIELD["scheduler"], scheduler):
        raise ValueError(f"`scheduler`: {why}")


def encode_image(image: Any, prompt: Prompt, model: str, used: dict[str, str | None] | None = None) -> bytes:
    """The image in the prompt's format (``renderfleet.images``), any failure the prompt's
    (:class:`PromptError`): text its format cannot carry.  ``used``: what the model's family
    records beyond the prompt's settings (None: a setting it ignored, not recorded)."""
    try:
        # Pixels from the renderer become PIL here, in the encode pool, not on the render thread.
        pil = outputs.to_pil(image)
        return images.encode(pil, prompt.image_format, prompt.quality, image_metadata(prompt, model, used))
    except Exception as exc:
        raise PromptError(f"cannot encode the image of {prompt.name!r}: {type(exc).__name__}: {exc}") from exc


def encode_png(image: Any, prompt: Prompt, model: str) -> bytes:
    """An image (PIL, or ``worker.render.outputs.Pixels``) as PNG bytes, with the prompt's settings as text chunks.

    Deterministic: no time chunk, fixed compression, fixed chunk order.
    """
    return images.encode(outputs.to_pil(image), "png", prompt.quality, image_metadata(prompt, model))


# The text chunk that marks every image of a bench model (worker/render/benchrender.py), beside its id in ``model``.
FAKE_CHUNK = {"renderfleet:fake": "fixed-time benchmark renderer, not a render"}


def image_metadata(prompt: Prompt, model: str, used: dict[str, str | None] | None = None) -> dict[str, str]:
    """What is written into every image, in a fixed order; a bench model's marked as fake.

    The settings added after the first release (scheduler, how long prompts were read, the
    format and its quality, the weights pinned: revision, variant, the model's digest and the
    LoRAs) are written where they differ from the default, so an image of a job that sets none
    of them keeps the bytes it always had.
    """
    chunks = {
        "prompt": prompt.prompt,
        "negative_prompt": prompt.negative_prompt,
        "seed": str(prompt.seed),
        "steps": str(prompt.steps),
        "guidance": repr(float(prompt.guidance)),
        "width": str(prompt.width),
        "height": str(prompt.height),
        "model": model,
        "renderfleet": __version__,
    }
    for name in (
        "scheduler",
        "long_prompts",
        "image_format",
        "quality",
        "revision",
        "variant",
        "model_digest",
        "skip_stages",
    ):
        value = getattr(prompt, name)
        if value != FIELD[name].default:
            chunks[name] = str(value)
    if prompt.loras:  # [[source, scale], ...]: a source may hold any character but a NUL
        chunks["loras"] = json.dumps([list(lora) for lora in prompt.loras], ensure_ascii=False)
    for name, value in (used or {}).items():  # the family's: a setting it ignored dropped, one it added kept
        if value is None:
            chunks.pop(name, None)
        else:
            chunks[name] = value
    return {**chunks, **FAKE_CHUNK} if model.startswith(BENCH_PREFIX) else chunks


png_metadata = image_metadata  # the name the bench renderer and older tests know


def release_cached_memory(device: str) -> None:
    """After an out-of-memory: collect what the failed call left (its frames may sit in
    reference cycles), then hand torch's cached blocks back to the driver, so the halved
    batch starts from a clean card.  The caller must hold no reference to the exception."""
    import gc

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def reset_peak_memory(device: str) -> None:
    """Start the card's memory peak afresh: the worker's peak gauge
    (``worker.accounting.metrics.GPU_PEAK``) reads the peak since the batch in flight began,
    not since the process began (a batch-size probe runs the card to its
    capacity on purpose, and that peak would stick for good)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
