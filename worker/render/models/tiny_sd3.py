"""The built-in ``tiny-sd3`` model: a Stable Diffusion 3 pipeline with random weights.

What makes it SD3: a joint-attention transformer (MMDiT) over 2x2 patches of a
16-channel latent, three text encoders (two CLIP with projection, whose pooled
outputs are concatenated, and a T5 whose tokens go beside the CLIP ones, up to
``max_sequence_length`` 256 by default, 512 at most), and a flow-matching
scheduler with SD3's shift of 3.  The VAE uses SD3's latent shift and scale.

Sizes follow diffusers' own SD3 pipeline tests.  The VAE halves each side once
(``vae_scale_factor`` 2) and the transformer takes 2x2 patches, so width and
height must be multiples of 4 (real SD3: 16) and at most 1024 (the positional
table's 256 patches a side).  A smoke-test model: its images are noise.
"""

from __future__ import annotations

import logging
from typing import Any

from worker.render.models.tiny import (
    eval_models,
    tiny_clip_config,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
    tiny_tokenizer,
    tiny_vae,
    tiny_warning,
)

log = logging.getLogger(__name__)

TINY_SD3 = "tiny-sd3"
_LATENT_CHANNELS = 16
_PROJECTION_DIM = 32
# Patches a side in the transformer's positional table: 1024 pixels at 2 x 2.
_POS_EMBED_MAX_SIZE = 256


def build_tiny_sd3() -> Any:
    """The built-in ``tiny-sd3`` model: a random-weight ``StableDiffusion3Pipeline``.

    Built as :func:`worker.render.models.tiny.build_tiny_pipeline` is: each component
    after ``torch.manual_seed(0)``, on the CPU, the global RNG left alone.
    """
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    log.warning(tiny_warning(TINY_SD3))
    tokenizer = tiny_tokenizer()
    tokenizer_2 = tiny_tokenizer()
    tokenizer_3 = tiny_t5_tokenizer()
    clip_config = tiny_clip_config(tokenizer, hidden_act="gelu", projection_dim=_PROJECTION_DIM)

    with torch.random.fork_rng(devices=[]):
        text_encoder_3 = tiny_t5_encoder(tokenizer_3)
        torch.manual_seed(0)
        transformer = SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=_LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            # The T5's width; the two CLIPs' 32 + 32 are cut to it, as SD3's are padded to it.
            joint_attention_dim=text_encoder_3.config.d_model,
            pooled_projection_dim=2 * _PROJECTION_DIM,  # both CLIPs' pooled outputs
            pos_embed_max_size=_POS_EMBED_MAX_SIZE,
        )
        torch.manual_seed(0)
        vae = tiny_vae(  # SD3's VAE's: 16 latent channels, no quant convs, shifted and scaled
            _LATENT_CHANNELS, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035
        )
        torch.manual_seed(0)
        text_encoder = CLIPTextModelWithProjection(clip_config)
        torch.manual_seed(0)
        text_encoder_2 = CLIPTextModelWithProjection(clip_config)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3's

    pipe: Any = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    eval_models(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe
