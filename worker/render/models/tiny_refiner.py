"""The built-in ``tiny-sdxl-refiner`` model: an SDXL refiner (image to image) with random weights.

Made as the real ``stable-diffusion-xl-refiner-1.0`` is, beside the base model: a
``StableDiffusionXLImg2ImgPipeline`` with the second text encoder alone (no
``text_encoder``/``tokenizer``), whose hidden states alone are the UNet's text
(cross-attention width 32, not the base's 64), and an aesthetic score in place of
the target size among the numbers embedded with the pooled text
(``requires_aesthetics_score``: 5 numbers, not 6).  A refine stage
(``renderfleet/stages.py``) uses it; it renders no image from text.  The other
parts are :mod:`.tiny_sdxl`'s.  A smoke-test model: its images are noise.
"""

from __future__ import annotations

import logging
from typing import Any

from worker.render.models.tiny import eval_models, tiny_tokenizer, tiny_warning
from worker.render.models.tiny_sdxl import tiny_sdxl_scheduler, tiny_sdxl_text_config, tiny_sdxl_unet, tiny_sdxl_vae

log = logging.getLogger(__name__)

TINY_SDXL_REFINER = "tiny-sdxl-refiner"


def build_tiny_sdxl_refiner() -> Any:
    """The built-in ``tiny-sdxl-refiner`` model: a random-weight ``StableDiffusionXLImg2ImgPipeline``.

    Built as the other tiny models are: each component after ``torch.manual_seed(0)``, on the
    CPU, the global RNG left alone, in eval mode, no watermark.
    """
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline
    from transformers import CLIPTextModelWithProjection

    log.warning(tiny_warning(TINY_SDXL_REFINER))
    tokenizer_2 = tiny_tokenizer()
    text_config = tiny_sdxl_text_config(tokenizer_2)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # The refiner's time ids: original size (2), crop corner (2), aesthetic score (1).
        unet = tiny_sdxl_unet(cross_attention_dim=text_config.hidden_size, time_ids=5)
        scheduler = tiny_sdxl_scheduler()
        torch.manual_seed(0)
        vae = tiny_sdxl_vae()
        torch.manual_seed(0)
        text_encoder_2 = CLIPTextModelWithProjection(text_config)

    pipe: Any = StableDiffusionXLImg2ImgPipeline(
        vae=vae,
        text_encoder=None,
        text_encoder_2=text_encoder_2,
        tokenizer=None,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        requires_aesthetics_score=True,
        force_zeros_for_empty_prompt=False,  # the real refiner's setting
        add_watermarker=False,
    )
    eval_models(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe
