"""The built-in ``tiny-sdxl`` model: a Stable Diffusion XL pipeline with random weights.

What makes it SDXL: two CLIP text encoders whose penultimate hidden states are
concatenated (32 + 32 = the UNet's cross-attention width, 64), the second one
with a projection whose pooled output, with the six size and crop numbers,
conditions the UNet (``addition_embed_type="text_time"``).  Sizes follow
diffusers' own SDXL pipeline tests.  The VAE halves each side once
(``vae_scale_factor`` 2): any width and height that are multiples of 8 render.
A smoke-test model: its images are noise.
"""

from __future__ import annotations

import logging
from typing import Any

from worker.render.models.tiny import eval_models, tiny_clip_config, tiny_tokenizer, tiny_vae, tiny_warning

log = logging.getLogger(__name__)

TINY_SDXL = "tiny-sdxl"
# SDXL adds six numbers (original size, crop corner, target size), each embedded in
# addition_time_embed_dim, to the second encoder's pooled text (projection_dim).
_TIME_EMBED_DIM = 8
_PROJECTION_DIM = 32


def build_tiny_sdxl() -> Any:
    """The built-in ``tiny-sdxl`` model: a random-weight ``StableDiffusionXLPipeline``.

    Built as :func:`worker.render.models.tiny.build_tiny_pipeline` is: each component
    after ``torch.manual_seed(0)``, on the CPU, the global RNG left alone.
    No invisible watermark (``add_watermarker=False``): noise needs none, and
    the pixels must not depend on whether a worker has the package.
    """
    import torch
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    log.warning(tiny_warning(TINY_SDXL))
    tokenizer = tiny_tokenizer()
    tokenizer_2 = tiny_tokenizer()
    text_config = tiny_sdxl_text_config(tokenizer)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = tiny_sdxl_unet(cross_attention_dim=2 * text_config.hidden_size, time_ids=6)
        scheduler = tiny_sdxl_scheduler()
        torch.manual_seed(0)
        vae = tiny_sdxl_vae()
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(text_config)
        torch.manual_seed(0)
        text_encoder_2 = CLIPTextModelWithProjection(text_config)

    pipe: Any = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    eval_models(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_text_config(tokenizer: Any) -> Any:
    """The config of each tiny SDXL text encoder (hidden size 32, a projection for the pooled text)."""
    return tiny_clip_config(tokenizer, hidden_act="gelu", projection_dim=_PROJECTION_DIM)


def tiny_sdxl_unet(*, cross_attention_dim: int, time_ids: int) -> Any:
    """The tiny SDXL UNet, from the caller's seeded RNG: ``cross_attention_dim`` the text's width (both
    encoders' side by side for the base model, the second's alone for the refiner), ``time_ids`` the
    numbers embedded with the pooled text (6 for the base: sizes and crop; 5 for the refiner: sizes,
    crop and an aesthetic score)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=_TIME_EMBED_DIM,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=time_ids * _TIME_EMBED_DIM + _PROJECTION_DIM,
        cross_attention_dim=cross_attention_dim,
    )


def tiny_sdxl_scheduler() -> Any:
    """SDXL's own scheduler settings; Euler with no churn draws no noise while stepping, so the
    image depends on the starting latents alone."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )


def tiny_sdxl_vae() -> Any:
    """The tiny SDXL VAE (halves each side once), from the caller's seeded RNG."""
    return tiny_vae(scaling_factor=0.13025)  # SDXL's VAE's
