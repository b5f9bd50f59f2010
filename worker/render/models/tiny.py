"""The built-in ``tiny`` model, a Stable Diffusion 1.x pipeline with random weights,
and the parts its siblings of the other families share.

``tiny-sdxl``, ``tiny-sd3``, ``tiny-flux`` and ``tiny-flux-schnell`` are built
by their family's module (:mod:`.tiny_sdxl`, :mod:`.tiny_sd3`, :mod:`.tiny_flux`)
from the parts here: the byte-level CLIP tokenizer and its encoder's config, a
character-level T5 tokenizer and a tiny T5 encoder.  :mod:`.tiny_models` maps
each name to its builder.

Built from config with a fixed seed, so each is bit-identical everywhere and
needs no download; smoke-test models whose images are noise.  Nothing here runs
at import: torch, diffusers and transformers are imported when a model is built.
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

# The T5 tokenizer of the tiny SD3 and FLUX models: T5's three special ids
# (<pad> 0, </s> 1, <unk> 2), its word-start mark, then one piece per printable
# Latin-1 character (every other character is <unk>): 192 ids, which fit the
# encoder's vocab_size.  FLUX's T5 reads up to 512 tokens, SD3's 256.
_T5_VOCAB_SIZE = 256
_T5_MAX_TOKENS = 512
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")
_WORD_START = "\u2581"  # SentencePiece's "▁"


def tiny_warning(name: str) -> str:
    """The line a tiny model logs when it is built: its images are noise."""
    return f"model {name!r} is a random-weight smoke-test model; images are noise"


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
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel

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
        vae = tiny_vae()
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(tiny_clip_config(tokenizer))

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


def tiny_vae(latent_channels: int = 4, **extra: Any) -> Any:
    """The built-in models' VAE: two blocks (halves each side once), from the caller's seeded RNG;
    ``extra``: a family's own settings (its latent scaling and shift, no quant convs)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=latent_channels,
        **extra,
    )


def tiny_clip_config(tokenizer: Any, **extra: Any) -> Any:
    """The tiny CLIP text encoders' config (diffusers' pipeline tests' sizes), for
    :func:`tiny_tokenizer`'s ``tokenizer``; ``extra``: the family's own settings
    (SDXL's and SD3's ``hidden_act="gelu"``, ``projection_dim``)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
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
        **extra,
    )


def tiny_t5_tokenizer() -> Any:
    """A T5 tokenizer made here, with no SentencePiece model: a Unigram over single characters.

    transformers' own T5 tokenizer class built from a vocabulary (its ``vocab``
    argument: pieces and scores), so it has T5's pre-tokenizer (words marked
    with "▁"), its ``</s>`` appended to every text and its special ids; saved,
    it is a ``tokenizer.json`` that loads back to the same ids.  No sentinel
    (``<extra_id_N>``) tokens: an encoder-only model has no use for them.
    """
    from transformers import T5Tokenizer

    printable = [chr(c) for c in (*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100))]
    pieces = [*_T5_SPECIALS, _WORD_START, *printable]
    # Every character is a piece of its own, so each text has one segmentation
    # and the scores only have to be equal among the characters.
    vocab = [(piece, 0.0 if piece in _T5_SPECIALS else -2.0 if piece == _WORD_START else -3.0) for piece in pieces]
    assert len(vocab) <= _T5_VOCAB_SIZE
    return T5Tokenizer(
        vocab=vocab,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=_T5_MAX_TOKENS,
    )


def tiny_t5_encoder(tokenizer: Any) -> Any:
    """A 2-layer T5 encoder (d_model 32) for :func:`tiny_t5_tokenizer`'s ``tokenizer``,
    built with ``torch.manual_seed(0)`` under the caller's forked RNG.

    T5's positions are relative, so it reads any ``max_sequence_length``."""
    import torch
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=_T5_VOCAB_SIZE,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",  # T5 v1.1's, as SD3's and FLUX's encoders
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return T5EncoderModel(config)


def eval_models(pipe: Any) -> None:
    """Put each model of ``pipe`` in eval mode, as ``from_pretrained`` leaves one.

    A model built from its config is in training mode, and T5's has dropout:
    its renders would differ call to call and from a saved copy's."""
    import torch

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()


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
