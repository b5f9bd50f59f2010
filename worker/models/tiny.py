"""The built-in ``tiny`` model: a Stable Diffusion pipeline with random weights.

Built from config with a fixed seed, so it is bit-identical everywhere and needs
no download; a smoke-test model whose images are noise.  Nothing here runs at
import: torch, diffusers and transformers are imported when it is built.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TINY = "tiny"
TINY_WARNING = "model 'tiny' is a random-weight smoke-test model; images are noise"

# The tiny model's tokenizer: 2 special tokens, then every byte-level
# character alone and with CLIP's end-of-word suffix (2 + 2 * 256 = 514 ids),
# which fits the text encoder's vocab_size below.
_TINY_VOCAB_SIZE = 1000
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
_MAX_TOKENS = 77


def build_tiny_pipeline() -> Any:
    """The built-in ``tiny`` model: a random-weight Stable Diffusion pipeline.

    A smoke-test model, not a real one: its images are noise.  Its weights
    come from ``torch.manual_seed(0)`` before each component, on the CPU, so
    every machine builds the same bits (diffusers' own test models are made
    the same way).  The configs follow diffusers' SD pipeline tests; the
    tokenizer is a byte-level CLIP BPE with no merges, written to a temporary
    folder because nothing may be downloaded.  The global RNG is left as it
    was found.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    log.warning(TINY_WARNING)
    tokenizer = tiny_tokenizer()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=2,
            sample_size=32,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
        )
        # SD 1.x's scheduler settings; DDIM with eta=0 draws no noise while
        # stepping, so the image depends on the starting latents alone.
        scheduler = DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        )
        torch.manual_seed(0)
        vae = AutoencoderKL(
            block_out_channels=[32, 64],
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
            up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
            latent_channels=4,
        )
        torch.manual_seed(0)
        text_config = CLIPTextConfig(
            # The special ids are the tokenizer's, so the encoder pools at
            # the right place and pads with the token the tokenizer pads with.
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=32,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=5,
            vocab_size=_TINY_VOCAB_SIZE,
            max_position_embeddings=_MAX_TOKENS,
        )
        text_encoder = CLIPTextModel(text_config)

    pipe: Any = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_tokenizer() -> Any:
    """A CLIP tokenizer from files written here: every byte, no merges."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {_BOS: 0, _EOS: 1}
    for token in chars + [c + "</w>" for c in chars]:
        vocab[token] = len(vocab)
    assert len(vocab) <= _TINY_VOCAB_SIZE

    with tempfile.TemporaryDirectory(prefix="renderfleet-tiny-tok-") as tmp:
        folder = Path(tmp)
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
        tokenizer = CLIPTokenizer.from_pretrained(folder, model_max_length=_MAX_TOKENS)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's map from bytes to printable characters (their BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))
