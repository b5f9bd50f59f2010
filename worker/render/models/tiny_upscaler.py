"""The built-in ``tiny-x4-upscaler`` model: a Stable Diffusion x4 upscaler with random weights.

Made as the real ``stabilityai/stable-diffusion-x4-upscaler`` is: a
``StableDiffusionUpscalePipeline`` whose UNet denoises latents the size of the
low-resolution image with that image beside them (7 input channels: 4 latent
and 3 of the image, noised to ``noise_level``, the UNet's class label), and
whose VAE decodes them at four times the size (three levels: ``vae_scale_factor``
4, ``scaling_factor`` 0.08333 like the real one's).  A v-prediction DDIM
scheduler (eta 0: no noise drawn while stepping) and a DDPM one that noises the
low-resolution image, with the real model's settings.  The text encoder and
tokenizer are :mod:`.tiny`'s.  An upscale stage (``renderfleet/stages.py``)
uses it; a smoke-test model: its images are noise.
"""

from __future__ import annotations

import logging
from typing import Any

from worker.render.models.tiny import eval_models, tiny_clip_config, tiny_tokenizer, tiny_warning

log = logging.getLogger(__name__)

TINY_X4_UPSCALER = "tiny-x4-upscaler"
_MAX_NOISE_LEVEL = 350  # the real upscaler's; its UNet embeds 1000 noise levels
_NOISE_LEVELS = 1000


def build_tiny_x4_upscaler() -> Any:
    """The built-in ``tiny-x4-upscaler`` model: a random-weight ``StableDiffusionUpscalePipeline``.

    Built as the other tiny models are: each component after ``torch.manual_seed(0)``, on the
    CPU, the global RNG left alone, in eval mode.  Small enough to upscale two 32x32 images
    to 128x128 in 2 steps in well under a second on one CPU thread.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        DDPMScheduler,
        StableDiffusionUpscalePipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel

    log.warning(tiny_warning(TINY_X4_UPSCALER))
    tokenizer = tiny_tokenizer()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            sample_size=32,
            in_channels=7,  # the latents (4) and the noised low-resolution image (3)
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            use_linear_projection=True,
            num_class_embeds=_NOISE_LEVELS,  # the low-resolution image's noise level
        )
        scheduler = DDIMScheduler(
            beta_start=0.0001,
            beta_end=0.02,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
            prediction_type="v_prediction",
        )
        low_res_scheduler = DDPMScheduler(
            beta_start=0.0001,
            beta_end=0.02,
            beta_schedule="scaled_linear",
            clip_sample=False,
        )
        torch.manual_seed(0)
        vae = AutoencoderKL(
            block_out_channels=[32, 32, 64],
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 3,
            up_block_types=["UpDecoderBlock2D"] * 3,
            latent_channels=4,
            scaling_factor=0.08333,  # the real upscaler's VAE's
        )
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(tiny_clip_config(tokenizer))

    pipe: Any = StableDiffusionUpscalePipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        low_res_scheduler=low_res_scheduler,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        watermarker=None,
        max_noise_level=_MAX_NOISE_LEVEL,
    )
    eval_models(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe
