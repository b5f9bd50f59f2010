"""Running a render's later stages on a batch's images (``renderfleet/stages.py``: what each is).

:class:`StageRenderer` is built once per stage of a job and knows nothing of
queues or stores: a batch's images and their prompts in, one image per prompt
out, in order.  It is the part of the path after generate (shard -> batch ->
render -> **stages** -> store).

* An upscale without a model is a Lanczos resize (PIL): no model, no noise.
* An upscale with a model runs a diffusion x4 upscaler
  (``StableDiffusionUpscalePipeline``) guided by each prompt, at its own
  guidance and noise level (:data:`UPSCALER_GUIDANCE`, :data:`UPSCALER_NOISE_LEVEL`:
  the pipeline's documented defaults, pinned so a diffusers release cannot move them).
* An upscale with a GAN upscaler (``renderfleet.stages.is_gan_upscaler``: a
  ``.safetensors`` file on this worker, or the built-in ``tiny-esrgan``) runs
  ESRGAN's RRDBNet (``worker/render/models/esrgan.py``, our own copy: spandrel would
  bring torchvision, which cannot import beside our pinned torch) once over the
  batch: no prompt, no noise, its factor the model's own (a mismatch is the job's
  error, naming ``--upscale``).
* A refine runs image to image.  With the job's own model (``model`` '') it is
  ``AutoPipelineForImage2Image.from_pipe`` of the loaded pipeline: the same
  components, no second copy in memory; it renders with the job's sampler and,
  given the job renderer's :class:`~worker.render.loras.LoraCache`, its LoRAs.  Another
  model is loaded as image to image (``load_pipeline(task="image-to-image")``)
  and renders with its own scheduler and no LoRA.  Either way the call's text,
  guidance and family-specific arguments are the model family's
  (``worker/render/models/families``: FLUX's true CFG for a negative prompt, SD3's and
  FLUX's T5 length), as generate's are.  Prompts over CLIP's 77 tokens are cut
  there (no chunking in a stage).

Between stages an image goes as pixels, or as latents where the next stage is a refine on a model
of the same latent space (``renderfleet.stages.hands_latents``: SDXL's base to its refiner): a
stage is then given latents as ``image`` (the image-to-image pipeline takes them as they are: no
encode) and asked for latents (``output="latent"``: no decode).

Every image depends on its prompt, its input image and the stage alone: each
prompt gets its own CPU generator seeded with :func:`renderfleet.stages.stage_seed`
(the prompt's seed and the stage's position), so a re-run of a batch gives the
same bytes at the same thread count (and batch composition, as generate's).
Errors are classed as the renderer's are (``worker/render/pipeline.py``): the model
refusing the settings is the job's (:class:`JobError`), out of memory halves
the batch (:class:`OutOfMemory`), a failing device is the node's
(:class:`DeviceError`), images that are not images are rendered once more with
the VAE in float32 and then refused (:class:`BadOutput`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from renderfleet.errors import (
    BadOutput,
    DeviceError,
    JobError,
    ModelLoadError,
    OutOfMemory,
    PermanentError,
    Reclaimed,
    RenderfleetError,
)
from renderfleet.spec import Prompt
from renderfleet.stages import (
    DIFFUSION_UPSCALE_FACTOR,
    FLAGS,
    REFINE,
    TINY_ESRGAN,
    UPSCALE,
    Stage,
    describe,
    is_gan_upscaler,
    stage_problem,
    stage_seed,
)
from worker.render import outputs
from worker.render.deviceerrors import call_failure, first_line, is_device_error
from worker.render.models import LoadedModel, load_pipeline, model_refusal, set_vae_memory_modes, vae_memory_modes
from worker.render.models.cuda import attention_kernels
from worker.render.models.families import FAMILIES, PipelineFamily
from worker.render.models.families.generic import Generic
from worker.render.pipeline import SchedulerCache, release_cached_memory
from worker.render.prompts import quiet_truncation
from worker.render.stagerun import is_latents, shape_of

if TYPE_CHECKING:
    from PIL import Image

    from worker.render.loras import LoraCache
    from worker.render.models import Fetch

log = logging.getLogger(__name__)

UPSCALER_GUIDANCE = 9.0  # StableDiffusionUpscalePipeline's default (the x4 upscaler is an SD 2 model, CFG)
UPSCALER_NOISE_LEVEL = 20  # its default: how much noise the low-resolution image gets before denoising
UPSCALE_PIPELINE = "StableDiffusionUpscalePipeline"


class StageRenderer:
    """Runs one stage (``stage``, at position ``index`` after generate: 0 first) on batches of images.

    ``base``: the job's loaded model (a refine with ``model`` '' shares its components);
    ``device``, ``cache_dir``, ``fetch``: where and how a stage's own model is loaded
    (``worker.render.models.load_pipeline``), if the worker's allow-list (``allowed``: None for none)
    lets it; :class:`ModelLoadError` if it cannot be, whatever the reason (a bad file, a shape out of
    range, out of memory while loading: the job's error, never the worker's; :meth:`_loading`).
    ``schedulers`` and ``loras``: the job renderer's, so a refine with the job's model uses the
    sampler and LoRAs generate used (without ``schedulers`` its default is the scheduler ``base``
    holds when this is built; without ``loras`` the adapters generate left switched on).  Built once per stage and kept: a
    model is loaded here, never per batch.  After each run, ``last_seconds`` is its wall time.
    """

    def __init__(
        self,
        stage: Stage,
        index: int,
        *,
        base: LoadedModel | None,
        device: str,
        cache_dir: Path,
        fetch: Fetch | None = None,
        allowed: Sequence[str] | None = None,
        schedulers: SchedulerCache | None = None,
        loras: LoraCache | None = None,
    ) -> None:
        if why := stage_problem(stage):
            raise JobError(f"stage {index + 1}: {why}")
        self.stage = stage
        self.index = index
        self.device = device
        self.last_seconds = 0.0
        self.pipe: Any = None  # None: a Lanczos resize or a GAN upscaler
        self.gan: Any = None  # a GAN upscaler's network (worker/render/models/esrgan.py)
        self.family: PipelineFamily | None = None
        self._own: LoadedModel | None = None  # a model this stage loaded for itself
        self._shared = ""  # the job's model, whose components a refine with it shares
        self._schedulers: SchedulerCache | None = None
        self._loras: LoraCache | None = None
        # How its batch size is remembered (worker/render/batchsize.py): the weights' kind, as generate's record says it.
        self.compiled = False
        self.quantize = "none"
        self.attention = "auto"  # which attention kernel its calls try first: generate's, for a refine sharing its model

        # 1. A Lanczos resize needs nothing.
        if stage.kind == UPSCALE and not stage.model:
            return
        # 2. A GAN upscaler: an RRDBNet read from safetensors, its scale the factor's.
        if stage.kind == UPSCALE and is_gan_upscaler(stage.model):
            with self._loading():
                self._load_gan(cache_dir, allowed)
            return
        # 3. A refine with the job's own model shares its components.
        if stage.kind == REFINE and not stage.model:
            self._share(base, schedulers, loras)
        # 4. Any other stage loads its own model.
        else:
            self._load_own(device, cache_dir, fetch, allowed)
        # 5. Either served quiet.
        self._quiet()

    def _share(self, base: LoadedModel | None, schedulers: SchedulerCache | None, loras: LoraCache | None) -> None:
        """A refine with the job's own model: an image-to-image pipeline of the job's components, with the job's
        scheduler as loaded, its LoRAs, and the kind of its weights."""
        if base is None:
            raise ValueError("a refine with the job's own model needs the job's loaded model (base)")
        self.device, self._shared = str(base.device), base.model
        default = schedulers.default if schedulers is not None else base.pipe.scheduler
        self.pipe = self._image_to_image(base.pipe, base.model, scheduler=default)
        self.family = image_family(self.pipe)
        self._schedulers = SchedulerCache(self.pipe, self.family)
        self._loras = loras
        self.compiled, self.quantize, self.attention = bool(base.compiled), str(base.quantize), str(base.attention)

    def _load_own(self, device: str, cache_dir: Path, fetch: Fetch | None, allowed: Sequence[str] | None) -> None:
        """Any other stage: its own model, if the allow-list lets it (:class:`ModelLoadError` if not), loaded as
        an upscaler (checked to be one) or as image to image."""
        stage = self.stage
        if why := model_refusal(stage.model, allowed):
            raise ModelLoadError(why)
        task = "any" if stage.kind == UPSCALE else "image-to-image"
        with self._loading():
            self._own = load_pipeline(stage.model, device=device, cache_dir=cache_dir, fetch=fetch, task=task)
        self.compiled, self.quantize = bool(self._own.compiled), str(self._own.quantize)
        if stage.kind == UPSCALE:
            self.pipe = self._own.pipe
            self._check_upscaler()
        else:
            self.pipe = self._image_to_image(self._own.pipe, stage.model)
            self.family = image_family(self.pipe)

    def _quiet(self) -> None:
        """No progress bar, and the text encoders' truncation warnings said once, on one line (as generate's)."""
        self.pipe.set_progress_bar_config(disable=True)
        quiet_truncation(self.pipe, self.family.family.t5_tokens if self.family else 0)

    def loaded_models(self) -> list[str]:
        """The models this stage holds, for a log line: its own, or the job's it shares (``tiny (shared)``);
        none for a Lanczos resize."""
        if self._own is not None:
            return [self._own.model]
        if self.gan is not None:
            return [self.stage.model]
        return [f"{self._shared} (shared)"] if self._shared else []

    def __str__(self) -> str:
        return f"stage {self.index + 1}: {describe(self.stage)}"

    @property
    def batch_key(self) -> tuple[str, str] | None:
        """(model, what the stage does) for its remembered batch size (worker/render/batchsize.py): the model it
        runs and ``upscale-x4`` or ``refine``, what its memory depends on beside the card and the size;
        None for a Lanczos resize, which holds nothing on a card."""
        if self.gan is not None:
            return self.stage.model, f"{self.stage.kind}-x{self.stage.factor}"
        if self.pipe is None:
            return None
        model = self._own.model if self._own is not None else self._shared
        return model, (f"{self.stage.kind}-x{self.stage.factor}" if self.stage.kind == UPSCALE else self.stage.kind)

    def pixel_size(self, image: Any) -> tuple[int, int]:
        """(width, height) in pixels of an input: an image's, or latents' times the VAE's scale."""
        if not is_latents(image):
            return tuple(image.size)  # type: ignore[return-value]
        scale = int(getattr(self.pipe, "vae_scale_factor", 8))
        return int(image.shape[-1]) * scale, int(image.shape[-2]) * scale

    def run(
        self,
        images: Sequence[Image.Image],
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
        output: str = "pil",
        steps: int | None = None,
    ) -> list[Any]:
        """One image per prompt, in order: ``images[i]`` (the stage before's: PIL images, or latents
        where :func:`renderfleet.stages.hands_latents` says so) through this stage; ``output``
        ``"latent"``: the latents, not decoded (a refine's, for a refine of its latent space).
        ``steps``: in place of the stage's (a batch-size probe's few: memory does not grow with them).

        ``should_stop`` is asked before starting, between calls and, where the pipeline lets it,
        after every step: once it says yes, :class:`Reclaimed` is raised.  Raises ``ValueError``
        for images and prompts that cannot share a run, :class:`JobError` when the model refuses
        the settings, :class:`OutOfMemory`, :class:`DeviceError` (:class:`BadOutput` among them)
        and :class:`PermanentError` as the renderer does.
        """
        # 1. Check the inputs: a batch's images, one per prompt, of one size (generate's pixels made PIL).
        images, prompts = [outputs.to_pil(image) for image in images], list(prompts)
        if not prompts or len(images) != len(prompts):
            raise ValueError(f"`images` and `prompts` must be as many and not none, got {len(images)} and {len(prompts)}")
        if len({shape_of(image) for image in images}) != 1:
            raise ValueError(f"all images of a batch must be of one size, got {sorted({shape_of(i) for i in images})}")
        if output not in ("pil", "latent") or (output == "latent" and self.stage.kind != REFINE):
            raise ValueError(f"`output` is 'pil', or 'latent' for a refine, got {output!r} for {self}")

        # 2. Stop before starting if asked to.
        if should_stop():
            raise Reclaimed(f"stopped before {self}")

        started = time.perf_counter()
        try:
            # 3. A Lanczos resize: no model, no noise.
            if self.gan is not None:
                return self._gan_call(images)
            if self.pipe is None:
                return [_lanczos(image, self.stage.factor) for image in images]

            # 4. A call per group of prompts that may share one (FLUX: with a negative prompt or without).
            groups: dict[Any, list[int]] = {}
            for i, p in enumerate(prompts):
                groups.setdefault(self.family.call_group(p) if self.family else None, []).append(i)
            out: list[Any] = [None] * len(prompts)
            for n, group in enumerate(groups.values()):
                if n > 0 and should_stop():
                    raise Reclaimed(f"stopped mid-batch in {self}")
                rendered = self._call_checked(
                    [prompts[i] for i in group], [images[i] for i in group], should_stop, output, steps or self.stage.steps
                )
                if len(rendered) != len(group):
                    raise PermanentError(f"{self}: the pipeline returned {len(rendered)} images for {len(group)} prompts")
                for i, image in zip(group, rendered, strict=True):
                    out[i] = image
            return out
        finally:
            self.last_seconds = time.perf_counter() - started

    # ---- building -------------------------------------------------------------------

    def _image_to_image(self, pipe: Any, model: str, **components: Any) -> Any:
        """``pipe``'s image-to-image pipeline, sharing its components (``components``: any to replace)."""
        from diffusers import AutoPipelineForImage2Image

        try:
            image_to_image = AutoPipelineForImage2Image.from_pipe(pipe, **components)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise JobError(
                f"stage {self.index + 1} (refine): model {model!r} ({type(pipe).__name__}) has no image-to-image "
                f"pipeline in diffusers: {first_line(exc)}"
            ) from exc
        params = inspect.signature(type(image_to_image).__call__).parameters
        if not {"image", "strength"} <= set(params):
            raise JobError(
                f"stage {self.index + 1} (refine): model {model!r}'s image-to-image pipeline "
                f"({type(image_to_image).__name__}) takes no strength; it cannot refine"
            )
        return image_to_image

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """Loading the stage's own model: any failure is the job's (:class:`ModelLoadError` naming the
        stage and the model), unless it is already classed (a :class:`JobError`, a store's
        :class:`TransientError`, a card too small) or the device itself failed (:class:`DeviceError`).
        A bare exception (``MemoryError``, torch's allocator, a library's ``OSError``) would reach the
        worker's service as an unexpected error and count against the worker (its breaker), though it
        fails the same way on every worker: issue 45, item 8."""
        try:
            yield
        except RenderfleetError:
            raise
        except Exception as exc:
            where = f"stage {self.index + 1} ({self.stage.kind}): model {self.stage.model[:200]!r}"
            if is_device_error(exc):
                raise DeviceError(f"{where}: loading it: {type(exc).__name__}: {first_line(exc)}") from exc
            raise ModelLoadError(f"{where} could not be loaded: {type(exc).__name__}: {first_line(exc)}") from exc

    def _load_gan(self, cache_dir: Path, allowed: Sequence[str] | None) -> None:
        """Load the stage's GAN upscaler, if the allow-list lets it; its scale must be the stage's factor."""
        from worker.render.models.esrgan import load_esrgan, tiny_esrgan_file

        model = self.stage.model
        if why := model_refusal(model, allowed):
            raise ModelLoadError(why)
        if model.startswith("s3://"):
            raise ModelLoadError(
                f"stage {self.index + 1} (upscale): model {model[:200]!r}: a GAN upscaler is read from a file on "
                "this worker (or the built-in tiny-esrgan); s3:// GAN weights are not fetched yet"
            )
        path = tiny_esrgan_file(cache_dir) if model == TINY_ESRGAN else Path(model)
        self.gan, config = load_esrgan(path, self.device)
        if config.scale != self.stage.factor:
            raise ModelLoadError(
                f"stage {self.index + 1} ({FLAGS[UPSCALE]} {self.stage.factor}:{model[:200]}): the model upscales "
                f"x{config.scale}, not x{self.stage.factor}; give {FLAGS[UPSCALE]} {config.scale}:{model[:200]}"
            )
        log.info("%s: RRDBNet %s", self, config)

    def _gan_call(self, images: list[Any]) -> list[Any]:
        """The batch through the GAN upscaler, errors classed as a pipeline call's are."""
        from worker.render.models.esrgan import upscale

        width, height = self.pixel_size(images[0])
        out_of_memory = ""
        try:
            return upscale(self.gan, images, self.device)
        except Exception as exc:
            if (failure := call_failure(exc, f"{self}: ")) is not None:
                raise failure from exc
            out_of_memory = first_line(exc)
        release_cached_memory(self.device)
        raise OutOfMemory(f"out of memory in {self} for {len(images)} images of {width}x{height}: {out_of_memory}")

    def _check_upscaler(self) -> None:
        name = type(self.pipe).__name__
        if name != UPSCALE_PIPELINE:
            raise ModelLoadError(
                f"stage {self.index + 1} (upscale): model {self.stage.model!r} is a {name}, not a diffusion "
                f"x4 upscaler ({UPSCALE_PIPELINE})"
            )
        factor = getattr(self.pipe, "vae_scale_factor", None)
        if factor != DIFFUSION_UPSCALE_FACTOR:
            raise ModelLoadError(
                f"stage {self.index + 1} (upscale): model {self.stage.model!r} upscales x{factor} (its VAE's "
                f"scale factor), not x{DIFFUSION_UPSCALE_FACTOR}"
            )

    # ---- the call -------------------------------------------------------------------

    def _kwargs(
        self, prompts: list[Prompt], images: list[Any], should_stop: Callable[[], bool], steps: int
    ) -> dict[str, Any]:
        """The pipeline call's arguments for ``prompts`` and their ``images``."""
        import torch

        # CPU generators: the same noise on every device.
        generators = [torch.Generator("cpu").manual_seed(stage_seed(p.seed, self.index)) for p in prompts]
        if self.stage.kind == UPSCALE:

            def on_step(step: int, timestep: Any, latents: Any) -> None:
                if should_stop():
                    raise Reclaimed(f"stopped mid-batch in {self}")  # a BaseException: no except swallows it

            kwargs: dict[str, Any] = {
                "prompt": [p.prompt for p in prompts],
                "negative_prompt": [p.negative_prompt for p in prompts],
                "image": images,
                "num_inference_steps": steps,
                "guidance_scale": UPSCALER_GUIDANCE,
                "noise_level": UPSCALER_NOISE_LEVEL,
                "generator": generators,
            }
            return kwargs | _taken(self.pipe, {"callback": on_step})

        def on_step_end(pipeline: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            if should_stop():
                raise Reclaimed(f"stopped mid-batch in {self}")
            return callback_kwargs

        assert self.family is not None
        width, height = self.pixel_size(images[0])
        kwargs = {
            **self.family.text_kwargs(prompts),
            **self.family.call_kwargs(prompts),  # guidance as the family means it: the prompt's
            "image": images,
            "strength": self.stage.strength,
            "num_inference_steps": steps,
            "generator": generators,
        }
        # SD3's and FLUX's image-to-image pipelines render at their default size unless told the image's.
        kwargs |= _taken(self.pipe, {"width": width, "height": height, "callback_on_step_end": on_step_end})
        return self.family.prune(kwargs)

    def _call_checked(
        self, prompts: list[Prompt], images: list[Any], should_stop: Callable[[], bool], output: str, steps: int
    ) -> list[Any]:
        """:meth:`_call`'s PIL images, none of them bad: a bad one's prompts run once more with the VAE
        in float32 (on a CPU, where it is, simply once more); still bad, :class:`BadOutput`.  Latents
        (``output`` ``"latent"``) as they come: no VAE has decoded them, the next stage's call checks."""
        if output == "latent":
            return list(self._call(prompts, images, should_stop, output, steps).images)
        rendered = outputs.check(self.pipe, self._call(prompts, images, should_stop, output, steps))
        if not rendered.bad:
            return [outputs.to_pil(image) for image in rendered]  # a stage's images are PIL: the next stage's input
        again = sorted(rendered.bad)
        with outputs.vae_in_float32(self.pipe) as upcast:
            second = outputs.check(
                self.pipe, self._call([prompts[i] for i in again], [images[i] for i in again], should_stop, output, steps)
            )
        how = "with the VAE upcast to float32" if upcast else "as it was (its VAE is in float32 already)"
        if second.bad:
            why = "; ".join(f"{prompts[again[j]].name}: {reason}" for j, reason in sorted(second.bad.items()))
            raise BadOutput(f"{self}: images that are not images, run again {how} and still bad ({why}): none stored")
        log.warning("%s: prompts %s gave bad images; run again %s, now good", self, [prompts[i].name for i in again], how)
        out = list(rendered)
        for i, image in zip(again, second, strict=True):
            out[i] = image
        return [outputs.to_pil(image) for image in out]

    def _call(
        self, prompts: list[Prompt], images: list[Any], should_stop: Callable[[], bool], output: str, steps: int
    ) -> Any:
        """One pipeline call: its output (PIL images asked as ``worker.render.outputs`` checks them, or latents)."""
        import torch

        if self._schedulers is not None:  # the job's sampler, as generate used it
            self._schedulers.use(prompts[0].scheduler, [stage_seed(p.seed, self.index) for p in prompts])
        if self._loras is not None:  # the job's adapters, as generate used them
            self._loras.use(prompts[0].loras)
        kwargs = self._kwargs(prompts, images, should_stop, steps)
        kwargs["output_type"] = outputs.ask_for(self.pipe, output)  # PIL: the pixel tensor, checked on its device
        width, height = self.pixel_size(images[0])
        factor = self.stage.factor if self.stage.kind == UPSCALE else 1
        if self.device.startswith("cuda"):  # the CPU path stays as it is
            set_vae_memory_modes(self.pipe, *vae_memory_modes(self.device, width * factor, height * factor, len(prompts)))

        out_of_memory = ""
        try:
            with torch.inference_mode(), attention_kernels(self.attention):
                made = self.pipe(**kwargs)
        except Exception as exc:
            if (failure := call_failure(exc, f"{self}: ")) is not None:
                raise failure from exc
            # Only its text leaves this block: the traceback's frames hold the call's activations.
            out_of_memory = first_line(exc)
        if out_of_memory:
            release_cached_memory(self.device)
            raise OutOfMemory(f"out of memory in {self} for {len(prompts)} images of {width}x{height}: {out_of_memory}")
        return made


def image_family(pipe: Any) -> PipelineFamily:
    """The family of an image-to-image pipeline: its text-to-image sibling's (diffusers' auto-pipeline
    tables pair them: ``StableDiffusionXLImg2ImgPipeline`` is SDXL's), so a refiner's call takes what
    its family's takes; :class:`Generic` where none is known."""
    from diffusers.pipelines.auto_pipeline import AUTO_IMAGE2IMAGE_PIPELINES_MAPPING, AUTO_TEXT2IMAGE_PIPELINES_MAPPING

    name = type(pipe).__name__
    for key, cls in AUTO_IMAGE2IMAGE_PIPELINES_MAPPING.items():
        if cls.__name__ == name and key in AUTO_TEXT2IMAGE_PIPELINES_MAPPING:
            name = AUTO_TEXT2IMAGE_PIPELINES_MAPPING[key].__name__
            break
    for family in FAMILIES:
        if name in family.facts.pipelines:
            return family(pipe)
    return Generic(pipe)


def _taken(pipe: Any, optional: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``optional`` that ``pipe``'s call takes (a stop callback is worth having, not
    a TypeError on every batch where a pipeline has none)."""
    params = inspect.signature(type(pipe).__call__).parameters
    return {k: v for k, v in optional.items() if k in params}


def _lanczos(image: Image.Image, factor: int) -> Image.Image:
    from PIL import Image

    return image.resize((image.width * factor, image.height * factor), Image.Resampling.LANCZOS)
