"""Scheduler (sampler) names a job may ask for, and what each means in diffusers.

Here, below both sides and without diffusers, so that ``submit`` refuses an
unknown name before anything is written and the worker's message check refuses
the same names (``spec.FIELDS``, row ``scheduler``).  The worker turns a name into
a scheduler built from its loaded pipeline's own scheduler config
(``worker.render.pipeline.SchedulerCache``): the model's betas and timestep settings stay
the model's, only the solver and the options its name implies change.

A name is one users know from A1111 and ComfyUI (``dpmpp_2m_karras``) or a
diffusers class name (``DPMSolverMultistepScheduler``: the class with the
model's config and no options of ours).  The empty name is the pipeline's own
scheduler, the default: a job that names none renders as before.
"""

from __future__ import annotations

import difflib
from typing import Any

# name -> (diffusers class, options the name implies).  The common names follow diffusers'
# own table of A1111 equivalents (docs: "Schedulers", A1111/k-diffusion names).
COMMON: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}),
    "ddpm": ("DDPMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "plms": ("PNDMScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "lms_karras": ("LMSDiscreteScheduler", {"use_karras_sigmas": True}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_karras": ("EulerDiscreteScheduler", {"use_karras_sigmas": True}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "heun_karras": ("HeunDiscreteScheduler", {"use_karras_sigmas": True}),
    "dpm2": ("KDPM2DiscreteScheduler", {}),
    "dpm2_karras": ("KDPM2DiscreteScheduler", {"use_karras_sigmas": True}),
    "dpm2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpm2_a_karras": ("KDPM2AncestralDiscreteScheduler", {"use_karras_sigmas": True}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "dpmpp_2m_sde_karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}),
    "dpmpp_2s": ("DPMSolverSinglestepScheduler", {}),
    "dpmpp_2s_karras": ("DPMSolverSinglestepScheduler", {"use_karras_sigmas": True}),
    # DPMSolverSDEScheduler draws its noise from a Brownian tree (the torchsde package).
    "dpmpp_sde": ("DPMSolverSDEScheduler", {}),
    "dpmpp_sde_karras": ("DPMSolverSDEScheduler", {"use_karras_sigmas": True}),
    "deis": ("DEISMultistepScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "unipc_karras": ("UniPCMultistepScheduler", {"use_karras_sigmas": True}),
    "lcm": ("LCMScheduler", {}),
    "tcd": ("TCDScheduler", {}),
}

# The flow-matching samplers (SD 3.x, FLUX.1: the model predicts a velocity, not noise), by the same
# names users know: "euler" on FLUX is flow-matching Euler.  Each is deterministic (none draws noise
# while stepping: those pipelines never hand the seeded generator to their scheduler).  The multistep
# solvers read the model's shift as their flow_shift (worker.render.pipeline.SchedulerCache).
FLOW_SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "euler": ("FlowMatchEulerDiscreteScheduler", {}),
    "heun": ("FlowMatchHeunDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}),
    "unipc": ("UniPCMultistepScheduler", {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}),
}

# The kinds of model a sampler drives: noise (epsilon/v) prediction, as SD 1.x/2.x and SDXL's UNets;
# flow matching (velocity), as SD 3.x's and FLUX.1's transformers.
DIFFUSION = "diffusion"
FLOW = "flow"
_BY_KIND = {DIFFUSION: COMMON, FLOW: FLOW_SAMPLERS}

# The diffusers classes a name may give directly: the ones above, all made for the
# epsilon/v-prediction UNet pipelines (SD 1.x/2.x, SDXL).
CLASSES: frozenset[str] = frozenset(cls for cls, _ in COMMON.values())

MAX_NAME_LEN = 64


def resolve(name: str, kind: str = DIFFUSION) -> tuple[str, dict[str, Any]]:
    """(diffusers class name, options) of a scheduler name for a model of ``kind``; KeyError for
    a name that is not one of that kind's."""
    table = _BY_KIND[kind]
    if name in table:
        cls, options = table[name]
        return cls, dict(options)
    if kind == DIFFUSION and name in CLASSES:
        return name, {}
    raise KeyError(name)


def names(kind: str) -> tuple[str, ...]:
    """The names a job may give for a model of ``kind`` (a class name too, for noise prediction)."""
    return tuple(_BY_KIND[kind]) + (tuple(sorted(CLASSES)) if kind == DIFFUSION else ())


def kind_of(name: str) -> str:
    """The kind of model ``name`` is made for (a name of both kinds counts as noise prediction's); ''
    for an unknown name."""
    if name in COMMON or name in CLASSES:
        return DIFFUSION
    return FLOW if name in FLOW_SAMPLERS else ""


def scheduler_problem(name: str) -> str | None:
    """Why ``name`` is not a scheduler a job may ask for, if it is not ('' is the pipeline's own)."""
    if name == "" or name in COMMON or name in CLASSES or name in FLOW_SAMPLERS:
        return None
    shown = name if len(name) <= MAX_NAME_LEN else name[:MAX_NAME_LEN] + "..."
    known = [*COMMON, *sorted(CLASSES), *(n for n in FLOW_SAMPLERS if n not in COMMON and n not in CLASSES)]
    close = difflib.get_close_matches(name[:MAX_NAME_LEN], known, n=2, cutoff=0.7)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (
        f"unknown scheduler {shown!r}: {hint}one of {', '.join(COMMON)}, or a diffusers class name "
        f"({', '.join(sorted(CLASSES))})"
    )
