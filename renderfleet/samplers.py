"""Scheduler (sampler) names a job may ask for, and what each means in diffusers.

Here, below both sides and without diffusers, so that ``submit`` refuses an
unknown name before anything is written and the worker's message check refuses
the same names (``spec.FIELDS``, row ``scheduler``).  The worker turns a name into
a scheduler built from its loaded pipeline's own scheduler config
(``worker.render.SchedulerCache``): the model's betas and timestep settings stay
the model's, only the solver and the options its name implies change.

A name is one users know from A1111 and ComfyUI (``dpmpp_2m_karras``) or a
diffusers class name (``DPMSolverMultistepScheduler``: the class with the
model's config and no options of ours).  The empty name is the pipeline's own
scheduler, the default: a job that names none renders as before.
"""

from __future__ import annotations

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

# The diffusers classes a name may give directly: the ones above, all made for the
# epsilon/v-prediction UNet pipelines (SD 1.x/2.x, SDXL) the worker serves.
CLASSES: frozenset[str] = frozenset(cls for cls, _ in COMMON.values())

MAX_NAME_LEN = 64


def resolve(name: str) -> tuple[str, dict[str, Any]]:
    """(diffusers class name, options) of a scheduler name; KeyError for an unknown one."""
    if name in COMMON:
        cls, options = COMMON[name]
        return cls, dict(options)
    if name in CLASSES:
        return name, {}
    raise KeyError(name)


def scheduler_problem(name: str) -> str | None:
    """Why ``name`` is not a scheduler a job may ask for, if it is not ('' is the pipeline's own)."""
    if name == "" or name in COMMON or name in CLASSES:
        return None
    shown = name if len(name) <= MAX_NAME_LEN else name[:MAX_NAME_LEN] + "..."
    return (
        f"unknown scheduler {shown!r}: one of {', '.join(COMMON)}, or a diffusers class name ({', '.join(sorted(CLASSES))})"
    )
