"""Model families: what each kind of pipeline takes, the one table both sides read.

A family is a kind of text-to-image pipeline whose settings mean the same thing:
Stable Diffusion 1.x/2.x and SDXL (a UNet that predicts noise, classifier-free
guidance, CLIP's 77 tokens), SD 3.x (a flow-matching transformer, CFG, CLIP and
T5) and FLUX.1 (a flow-matching transformer with guidance distilled into it, or
none for [schnell]; CLIP and T5).  Submit checks a job's settings against its
model's family wherever it can tell the family (:func:`family_here`: a built-in
model, a folder's ``model_index.json``); a worker checks them against the
pipeline it loaded (``worker/render/models/families``), and a setting the family cannot
honour is the job's error there, never a worker's.  Any other pipeline
``AutoPipelineForText2Image`` loads is :data:`GENERIC`: only the settings proven
for every pipeline.

Pure data and pure checks: no torch, no diffusers, nothing at import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from renderfleet import samplers


@dataclass(frozen=True)
class Family:
    """What a family of pipelines takes: its settings' meaning and defaults."""

    name: str  # sd, sdxl, sd3, flux, flux-schnell, generic
    title: str  # what a message calls it
    pipelines: tuple[str, ...]  # the diffusers pipeline classes it is (model_index.json's _class_name)
    sampler_kind: str  # samplers.DIFFUSION, samplers.FLOW, or '' (only the model's own)
    # (the scheduler names below: the kind's names this family's pipeline can drive, each tested on its tiny model)
    guidance: str  # "cfg" (classifier-free: guidance > 1 turns it on, doubling the work), "distilled", "none"
    negative: str  # "cfg": applied through CFG; "true_cfg": through true CFG (guidance stays distilled); "none"
    steps: int  # the default steps
    guidance_scale: float  # the default guidance (0.0 where there is none)
    size_multiple: int  # width and height must be multiples of it
    t5_tokens: int = 0  # the T5 encoder's sequence length (max_sequence_length); 0: no T5
    t5_max: int = 0  # the most it can read
    chunks: bool = False  # CLIP-only prompts over 77 tokens can be embedded in 77-token chunks
    lora: bool = True
    # Its image-to-image pipeline takes its text-to-image latents as ``image`` (4 channels, not packed, scaled
    # as the VAE encodes): a refine of the same family gets them without a decode and an encode between
    # (renderfleet.stages.hands_latents).  FLUX's are packed and SD3's shifted: they go as images.
    latents: bool = False
    memory_1024_bf16: str = ""  # the weights' bytes in bf16 (parameters x 2), for the docs' table; activations come on top
    # What `submit --estimate` assumes where no speed was measured (renderfleet/speeds.py): seconds per
    # megapixel and step at the family's default guidance on a mid-range card (24-48 GB, A10G to L40S
    # class).  Rough on purpose and said to be assumed: a bench run or a job's batches replace it.
    seconds_per_mpstep: float = 0.3

    only_samplers: tuple[str, ...] = ()  # where not every name of the kind works: these

    @property
    def samplers(self) -> tuple[str, ...]:
        """The sampler names a job may ask for on this family ('' is always the model's own)."""
        if self.only_samplers:
            return self.only_samplers
        return samplers.names(self.sampler_kind) if self.sampler_kind else ()


SD = Family(
    "sd",
    "Stable Diffusion 1.x/2.x",
    ("StableDiffusionPipeline",),
    samplers.DIFFUSION,
    "cfg",
    "cfg",
    steps=30,
    guidance_scale=7.5,
    size_multiple=8,
    chunks=True,
    latents=True,
    memory_1024_bf16="2.1 GB of weights (SD 1.5: UNet 0.86 B parameters, CLIP 0.12 B, VAE 0.08 B)",
    seconds_per_mpstep=0.15,
)
SDXL = Family(
    "sdxl",
    "Stable Diffusion XL",
    ("StableDiffusionXLPipeline",),
    samplers.DIFFUSION,
    "cfg",
    "cfg",
    # SDXL's pipeline defaults to 5.0; renderfleet's 7.5 stays, so a job submitted before families keeps its id
    steps=30,
    guidance_scale=7.5,
    size_multiple=8,
    chunks=True,
    latents=True,
    memory_1024_bf16="6.9 GB of weights (UNet 2.57 B, two CLIP 0.82 B, VAE 0.08 B); 11.6 GB peak at batch 16 on an H200",
    seconds_per_mpstep=0.35,
)
SD3 = Family(
    "sd3",
    "Stable Diffusion 3.x",
    ("StableDiffusion3Pipeline",),
    samplers.FLOW,
    "cfg",
    "cfg",
    steps=28,
    guidance_scale=7.0,
    size_multiple=16,
    t5_tokens=256,
    t5_max=512,
    memory_1024_bf16=(
        "27.5 GB of weights for SD 3.5 Large (transformer 8.1 B, T5-XXL 4.76 B, two CLIP 0.82 B); 16 GB for Medium (2.5 B)"
    ),
    seconds_per_mpstep=0.5,
)
FLUX = Family(
    "flux",
    "FLUX.1 [dev]",
    ("FluxPipeline",),
    samplers.FLOW,
    "distilled",
    "true_cfg",
    steps=28,
    guidance_scale=3.5,
    size_multiple=16,
    t5_tokens=512,
    t5_max=512,
    # FluxPipeline hands its scheduler sigmas (and a shift): Heun's set_timesteps takes neither
    only_samplers=("euler", "dpmpp_2m", "unipc"),
    memory_1024_bf16="33.7 GB of weights (transformer 11.9 B, T5-XXL 4.76 B, CLIP 0.12 B): over a 24 GB card",
    seconds_per_mpstep=1.0,
)
FLUX_SCHNELL = Family(
    "flux-schnell",
    "FLUX.1 [schnell]",
    ("FluxPipeline",),
    samplers.FLOW,
    "none",
    "true_cfg",
    steps=4,
    guidance_scale=0.0,
    size_multiple=16,
    t5_tokens=256,
    t5_max=256,
    # and without dynamic shifting DPM++ 2M fails FluxPipeline's timesteps (an AssertionError in diffusers)
    only_samplers=("euler", "unipc"),
    memory_1024_bf16="33.7 GB of weights, as [dev]",
    seconds_per_mpstep=1.0,
)
GENERIC = Family(
    "generic",
    "a pipeline of no known family",
    (),
    "",
    "cfg",
    "none",
    steps=30,
    guidance_scale=7.5,
    size_multiple=8,
    lora=False,
)

FAMILIES: tuple[Family, ...] = (SD, SDXL, SD3, FLUX, FLUX_SCHNELL, GENERIC)
BY_NAME = {f.name: f for f in FAMILIES}

# The built-in random-weight models (worker/render/models/tiny*.py), by family: demos and tests, their images noise.
TINY_MODELS: dict[str, Family] = {
    "tiny": SD,
    "tiny-sdxl": SDXL,
    "tiny-sd3": SD3,
    "tiny-flux": FLUX,
    "tiny-flux-schnell": FLUX_SCHNELL,
}

# Well-known hub ids by family, known without the hub (an estimate offline, a hub that does not answer):
# an SDXL id priced at SD 1.x's rate made a 200,000-image estimate 2.3x too cheap (issue 46).  Compared
# without case; a hub id not here is told by the hub's model info, as before.
KNOWN_HUB_IDS: dict[str, Family] = {
    **dict.fromkeys(
        (
            "runwayml/stable-diffusion-v1-5",
            "stable-diffusion-v1-5/stable-diffusion-v1-5",
            "compvis/stable-diffusion-v1-4",
            "stabilityai/stable-diffusion-2-1",
            "stabilityai/stable-diffusion-2-1-base",
            "stabilityai/sd-turbo",
        ),
        SD,
    ),
    **dict.fromkeys(
        (
            "stabilityai/stable-diffusion-xl-base-1.0",
            "stabilityai/sdxl-turbo",
            "playgroundai/playground-v2.5-1024px-aesthetic",
        ),
        SDXL,
    ),
    **dict.fromkeys(
        (
            "stabilityai/stable-diffusion-3-medium-diffusers",
            "stabilityai/stable-diffusion-3.5-medium",
            "stabilityai/stable-diffusion-3.5-large",
            "stabilityai/stable-diffusion-3.5-large-turbo",
        ),
        SD3,
    ),
    "black-forest-labs/flux.1-dev": FLUX,
    "black-forest-labs/flux.1-schnell": FLUX_SCHNELL,
}

# True CFG's scale where a FLUX job gives a negative prompt: diffusers' own example's; the transformer
# then runs twice per step (the prompt and the negative), so such a job costs about twice as much.
TRUE_CFG_SCALE = 4.0


def recognise(pipeline_class: str, guidance_embeds: bool | None = None) -> Family:
    """The family of a pipeline class (``model_index.json``'s ``_class_name``); FLUX's [schnell]
    is the one whose transformer has no guidance embedding (``guidance_embeds`` false)."""
    if pipeline_class == "FluxPipeline":
        return FLUX_SCHNELL if guidance_embeds is False else FLUX
    for family in FAMILIES:
        if pipeline_class in family.pipelines:
            return family
    return GENERIC


def family_here(model: str) -> Family | None:
    """The family of ``model`` as this machine can tell: a built-in model's, a well-known hub id's
    (:data:`KNOWN_HUB_IDS`), a folder's (its ``model_index.json``); None where it cannot (another hub
    id, an ``s3://`` prefix, a worker's path)."""
    if model in TINY_MODELS:
        return TINY_MODELS[model]
    if (known := KNOWN_HUB_IDS.get(model.lower())) is not None and not Path(model).expanduser().exists():
        return known
    folder = Path(model).expanduser()
    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        return None
    guidance_embeds = None
    if index["_class_name"] == "FluxPipeline":
        try:
            config = json.loads((folder / "transformer" / "config.json").read_text(encoding="utf-8"))
            guidance_embeds = bool(config.get("guidance_embeds", False))
        except (OSError, ValueError, AttributeError):
            guidance_embeds = None
    return recognise(index["_class_name"], guidance_embeds)


def defaults(family: Family | None) -> dict[str, Any]:
    """The steps and guidance a job that sets neither renders with on ``family`` (SD's where unknown)."""
    family = family or SD
    return {"steps": family.steps, "guidance": family.guidance_scale}


def setting_problems(
    family: Family,
    *,
    scheduler: str = "",
    negative_prompt: str = "",
    guidance: float | None = None,
    width: int | None = None,
    height: int | None = None,
    loras: Any = (),
    guidance_set: bool = True,
) -> list[str]:
    """Why ``family`` cannot honour these settings, one line each naming the setting; [] when it can.

    ``guidance_set``: the guidance was the user's, not the default (a family without guidance
    refuses only a guidance someone asked for)."""
    problems: list[str] = []
    if scheduler and scheduler not in family.samplers:
        problems.append(sampler_problem(family, scheduler))
    if negative_prompt:
        if family.negative == "none":
            problems.append(
                f"negative prompt: {family.title} takes none (its pipeline would record it and ignore it); leave it out"
            )
        elif family.negative == "cfg" and guidance is not None and guidance <= 1:
            problems.append(
                f"negative prompt: acts only through classifier-free guidance, which guidance {guidance:g} "
                "turns off; give guidance above 1 or leave the negative prompt out"
            )
    if guidance_set and guidance is not None and family.guidance == "none" and guidance != 0:
        problems.append(
            f"guidance {guidance:g}: {family.title} is distilled to render without guidance (its "
            f"{family.steps} steps); leave it out"
        )
    for name, value in (("width", width), ("height", height)):
        if value is not None and value % family.size_multiple:
            problems.append(f"{name} {value}: {family.title} needs a multiple of {family.size_multiple}")
    if loras and not family.lora:
        problems.append(f"LoRA: not proven on {family.title}; renderfleet loads LoRAs on SD, SDXL, SD 3.x and FLUX.1 only")
    return problems


def sampler_problem(family: Family, scheduler: str) -> str:
    """Why ``scheduler`` cannot drive ``family``: the kind it is and the names the family takes."""
    if not family.samplers:
        return (
            f"scheduler {scheduler!r}: {family.title} renders with its own scheduler only "
            "(none other is proven for it); leave --scheduler out"
        )
    kind = samplers.kind_of(scheduler)
    what = {
        samplers.DIFFUSION: "a noise-prediction (diffusion) sampler",
        samplers.FLOW: "a flow-matching sampler",
    }.get(kind, "not a sampler renderfleet knows")
    model_kind = "a flow-matching model" if family.sampler_kind == samplers.FLOW else "a noise-prediction model"
    return f"scheduler {scheduler!r}: {what}; {family.title} is {model_kind}: one of {', '.join(family.samplers)}"


def long_prompt_fate(family: Family | None, mode: str) -> str:
    """What the family does with a prompt over CLIP's 77 tokens, as submit's note says it."""
    if family is not None and family.t5_tokens:
        return (
            f"{family.title}'s CLIP encoder reads the first 77 tokens and its T5 encoder "
            f"{family.t5_tokens} (tokens past {family.t5_tokens} are cut)"
        )
    if mode == "chunk":
        return "embedded in 77-token chunks (long_prompts=chunk)"
    return "cut at 77 tokens, the rest ignored (long_prompts=truncate)"
