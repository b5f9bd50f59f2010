"""The built-in ``tiny-flux`` and ``tiny-flux-schnell`` models: FLUX.1 pipelines with random weights.

What makes it FLUX: a transformer of double-stream then single-stream blocks
over 2x2 patches of a 16-channel latent (packed: 64 channels a token), text
from a CLIP (its pooled output only) and a T5 (its tokens, up to
``max_sequence_length`` 512), and a flow-matching scheduler.  The dev-like
model embeds the guidance scale (``guidance_embeds``: no second, unconditional
pass) and shifts its schedule by the image's size, as FLUX.1-dev does; the
schnell-like one has neither, as FLUX.1-schnell.

Sizes follow diffusers' own FLUX pipeline tests.  The VAE halves each side
once (``vae_scale_factor`` 2) and latents are packed 2x2, so width and height
are multiples of 4 (real FLUX: 16; the pipeline rounds others down, with a
warning).  Positions are rotary: any size.  A smoke-test model: its images are noise.
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

TINY_FLUX = "tiny-flux"
TINY_FLUX_SCHNELL = "tiny-flux-schnell"
_LATENT_CHANNELS = 16


def build_tiny_flux(schnell: bool = False) -> Any:
    """The built-in ``tiny-flux`` model (``schnell``: ``tiny-flux-schnell``): a random-weight ``FluxPipeline``.

    Built as :func:`worker.render.models.tiny.build_tiny_pipeline` is: each component
    after ``torch.manual_seed(0)``, on the CPU, the global RNG left alone.
    The two differ in the transformer's guidance embedding and the scheduler.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    log.warning(tiny_warning(TINY_FLUX_SCHNELL if schnell else TINY_FLUX))
    tokenizer = tiny_tokenizer()
    tokenizer_2 = tiny_t5_tokenizer()

    with torch.random.fork_rng(devices=[]):
        text_encoder_2 = tiny_t5_encoder(tokenizer_2)
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(tiny_clip_config(tokenizer, hidden_act="gelu"))
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * _LATENT_CHANNELS,  # a token is a 2x2 patch of latents
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=text_encoder_2.config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size,
            guidance_embeds=not schnell,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        )
        torch.manual_seed(0)
        vae = tiny_vae(  # FLUX.1's VAE's: 16 latent channels, no quant convs, shifted and scaled
            _LATENT_CHANNELS, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611
        )
        if schnell:  # FLUX.1-schnell's: no shift at all
            scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        else:  # FLUX.1-dev's: the shift grows with the image's tokens (mu, from the pipeline)
            scheduler = FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=1000,
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            )

    pipe: Any = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    eval_models(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe
