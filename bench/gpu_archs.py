"""The GPU benchmark's architectures: configs at the real sizes and toy ones, their FLOPs, a pipeline of each.

SD 1.5 and SDXL are built whole; SD3.5-medium and FLUX.1-dev at their
published widths and heads but fewer blocks (:func:`depth`), their text
encoders tiny but for the widths the transformer reads.  FLOPs are counted
on the meta device (no compute, no memory), per block too, and at the full
published depth (:func:`at_full_depth`), so a reduced model's figures can be
scaled honestly.  A pipeline is built with random weights on the device it
renders on (:func:`build`), prepared as a worker prepares a CUDA model.
Used by ``bench/gpu_bench.py``; nothing here runs at import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Arch:
    """One architecture at its benchmark settings, its modules' configs."""

    name: str
    xl: bool
    width: int
    height: int
    steps: int
    guidance: float
    batches: tuple[int, ...]
    unet: dict[str, Any]
    vae: dict[str, Any]
    text: dict[str, Any]  # CLIP-L (SD 1.5, and SDXL's first encoder)
    text_2: dict[str, Any] = field(default_factory=dict)  # SDXL's OpenCLIP bigG, with projection
    family: str = "sd"  # "sd" (a UNet: SD 1.x, SDXL), "sd3" or "flux" (a transformer)
    transformer: dict[str, Any] = field(default_factory=dict)  # SD3Transformer2DModel's or FluxTransformer2DModel's
    t5: dict[str, Any] = field(default_factory=dict)  # the T5 encoder's config (tiny but for its width)
    text_tokens: int = 77  # the text sequence the denoiser reads: CLIP's 77, SD3's 77 + 256 of T5, FLUX-dev's 512
    full_depth: dict[str, Any] = field(default_factory=dict)  # the published config's block counts, where fewer are built

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance: two denoiser passes a step.  FLUX.1-dev is guidance-distilled (one pass)."""
        return self.guidance > 1 and self.family != "flux"


_VAE = {
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_CLIP_L = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}

SD15 = Arch(
    "sd15",
    False,
    512,
    512,
    25,
    7.5,
    (1, 4, 16, 32, 64),
    unet={
        "block_out_channels": (320, 640, 1280, 1280),
        "layers_per_block": 2,
        "cross_attention_dim": 768,
        "attention_head_dim": 8,
        "sample_size": 64,
        "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    },
    vae={**_VAE, "sample_size": 512},
    text=_CLIP_L,
)
SDXL = Arch(
    "sdxl",
    True,
    1024,
    1024,
    30,
    7.5,
    (1, 4, 8, 16),
    unet={
        "block_out_channels": (320, 640, 1280),
        "layers_per_block": 2,
        "transformer_layers_per_block": (1, 2, 10),
        "attention_head_dim": (5, 10, 20),
        "cross_attention_dim": 2048,
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,
        "sample_size": 128,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    },
    vae={**_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
    text=_CLIP_L,
    text_2={
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_attention_heads": 20,
        "num_hidden_layers": 32,
        "vocab_size": 49408,
        "max_position_embeddings": 77,
        "hidden_act": "gelu",
        "projection_dim": 1280,
    },
)


# SD3's and FLUX's VAE: SDXL's shape with 16 latent channels and no quant convs (their published configs).
_VAE16 = {
    **_VAE,
    "latent_channels": 16,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
    "sample_size": 1024,
}
# Text encoders the bench need not measure, tiny but for what the transformer reads of them: SD3's two CLIPs'
# projections (768 + 1280 = its pooled 2048), FLUX's CLIP width (its pooled 768), T5's width (both: 4096).
_TINY_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
}
_TINY_T5 = {
    "vocab_size": 1000,
    "d_model": 4096,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 1,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "feed_forward_proj": "gated-gelu",
}
# SD3.5-medium (stabilityai/stable-diffusion-3.5-medium, transformer/config.json): 24 joint blocks of
# 24 heads x 64, the first 13 with dual attention (MMDiT-X), qk RMS norm; built 6 deep, 3 of them dual.
SD35M = Arch(
    "sd35m",
    False,
    1024,
    1024,
    4,
    4.5,
    (1, 4),
    unet={},
    vae={**_VAE16, "scaling_factor": 1.5305, "shift_factor": 0.0609},
    text={**_TINY_CLIP, "projection_dim": 768},
    text_2={**_TINY_CLIP, "projection_dim": 1280},
    family="sd3",
    transformer={
        "sample_size": 128,
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": 6,
        "attention_head_dim": 64,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "caption_projection_dim": 1536,
        "pooled_projection_dim": 2048,
        "out_channels": 16,
        "pos_embed_max_size": 384,
        "dual_attention_layers": (0, 1, 2),
        "qk_norm": "rms_norm",
    },
    t5=_TINY_T5,
    text_tokens=77 + 256,
    full_depth={"num_layers": 24, "dual_attention_layers": tuple(range(13))},
)
# FLUX.1-dev (black-forest-labs/FLUX.1-dev, transformer/config.json): 19 double-stream and 38 single-stream
# blocks of 24 heads x 128, guidance embedded; built 4 + 4 deep.  Its T5 reads 512 tokens.
FLUX1 = Arch(
    "flux1",
    False,
    1024,
    1024,
    4,
    3.5,
    (1, 4),
    unet={},
    vae={**_VAE16, "scaling_factor": 0.3611, "shift_factor": 0.1159},
    text={**_TINY_CLIP, "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 1},
    family="flux",
    transformer={
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": 4,
        "num_single_layers": 4,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": True,
        "axes_dims_rope": (16, 56, 56),
    },
    t5=_TINY_T5,
    text_tokens=512,
    full_depth={"num_layers": 19, "num_single_layers": 38},
)
ARCHS = {a.name: a for a in (SD15, SDXL, SD35M, FLUX1)}
FAMILIES = ("sd35m", "flux1")  # --families: the transformer families alone


def depth(arch: Arch) -> str:
    """How deep the benchmark builds a transformer, against its published depth ('' for a UNet: built whole)."""
    if not arch.full_depth:
        return ""
    if arch.family == "flux":
        t = arch.transformer
        full = arch.full_depth
        return (
            f"{t['num_layers']} + {t['num_single_layers']} of {full['num_layers']} + {full['num_single_layers']} "
            "double- + single-stream blocks"
        )
    return f"{arch.transformer['num_layers']} of {arch.full_depth['num_layers']} joint blocks"


def at_full_depth(arch: Arch) -> Arch:
    """``arch`` with its published block counts (for FLOPs on the meta device: never built)."""
    return replace(arch, transformer={**arch.transformer, **arch.full_depth}, full_depth={})


def tiny(arch: Arch) -> Arch:
    """The same family at toy widths, 64x64 and 2 steps: proves the code runs on a CPU."""
    small_text = {
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 77,
        "projection_dim": 32,
    }
    vae = {
        **arch.vae,
        "block_out_channels": [32, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2,
        "sample_size": 64,
    }
    unet: dict[str, Any] = {
        "block_out_channels": (32, 64),
        "layers_per_block": 1,
        "sample_size": 8,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    }
    if arch.family == "sd3":
        return replace(
            arch,
            name=f"{arch.name}-tiny",
            width=64,
            height=64,
            steps=2,
            batches=(1, 2),
            vae=vae,
            text={**small_text, "projection_dim": 32, "hidden_act": "gelu"},
            text_2={**small_text, "projection_dim": 32, "hidden_act": "gelu"},
            transformer={
                **arch.transformer,
                "sample_size": 32,
                "num_layers": 3,
                "attention_head_dim": 8,
                "num_attention_heads": 4,
                "joint_attention_dim": 64,
                "caption_projection_dim": 32,
                "pooled_projection_dim": 64,
                "pos_embed_max_size": 32,
                "dual_attention_layers": (0,),
            },
            t5={**arch.t5, "d_model": 64},
            full_depth={"num_layers": 6, "dual_attention_layers": (0, 1, 2)},
        )
    if arch.family == "flux":
        return replace(
            arch,
            name=f"{arch.name}-tiny",
            width=64,
            height=64,
            steps=2,
            batches=(1, 2),
            vae=vae,
            text={**small_text, "hidden_size": 32},
            transformer={
                **arch.transformer,
                "num_layers": 1,
                "num_single_layers": 1,
                "attention_head_dim": 16,
                "num_attention_heads": 2,
                "joint_attention_dim": 64,
                "pooled_projection_dim": 32,
                "axes_dims_rope": (4, 6, 6),
            },
            t5={**arch.t5, "d_model": 64},
            full_depth={"num_layers": 2, "num_single_layers": 2},
        )
    if arch.xl:
        unet.update(
            transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4),
            cross_attention_dim=64,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 32,
        )
    else:
        unet.update(cross_attention_dim=32, attention_head_dim=4)
    return replace(
        arch,
        name=f"{arch.name}-tiny",
        width=64,
        height=64,
        steps=2,
        batches=(1, 2),
        unet=unet,
        vae=vae,
        text=small_text,
        text_2=small_text if arch.xl else {},
    )


# ---- FLOPs, counted on the meta device -------------------------------------------------------


def count_flops(arch: Arch) -> tuple[float, float]:
    """(denoiser FLOPs per denoising step per image, one pass: guidance doubles it; VAE decode FLOPs per image)."""
    step, vae, _ = count_flops_by_block(arch)
    return step, vae


def count_flops_by_block(arch: Arch) -> tuple[float, float, dict[str, float]]:
    """:func:`count_flops`, and a transformer's FLOPs per step per image of one block of each kind
    (``transformer_blocks``, ``single_transformer_blocks``: the mean over the blocks built)."""
    import torch
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    h, w = arch.height // 8, arch.width // 8
    with torch.device("meta"):
        model, inputs = _denoiser_on_meta(arch, h, w)
        vae: Any = AutoencoderKL(**arch.vae)
        with FlopCounterMode(display=False) as denoiser_count:
            model(**inputs)
        with FlopCounterMode(display=False) as vae_count:
            vae.decode(torch.empty(1, arch.vae["latent_channels"], h, w))
    images = 2  # the inputs hold two images (a prompt and its negative, one call): per image is half
    blocks: dict[str, list[int]] = {}
    for name, ops in denoiser_count.get_flop_counts().items():
        parts = name.split(".")
        if len(parts) == 3 and parts[1] in ("transformer_blocks", "single_transformer_blocks") and parts[2].isdigit():
            blocks.setdefault(parts[1], []).append(sum(ops.values()))
    per_block = {kind: sum(counts) / len(counts) / images for kind, counts in blocks.items()}
    return denoiser_count.get_total_flops() / images, float(vae_count.get_total_flops()), per_block


def _denoiser_on_meta(arch: Arch, h: int, w: int) -> tuple[Any, dict[str, Any]]:
    """The denoiser of ``arch`` (under the caller's meta device) and its inputs for two images at latents h x w."""
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

    timesteps = torch.full((2,), 10)
    if arch.family == "flux":
        model: Any = FluxTransformer2DModel(**arch.transformer)
        tokens = (h // 2) * (w // 2)  # 2x2 latent patches, packed
        return model, {
            "hidden_states": torch.empty(2, tokens, arch.transformer["in_channels"]),
            "encoder_hidden_states": torch.empty(2, arch.text_tokens, arch.transformer["joint_attention_dim"]),
            "pooled_projections": torch.empty(2, arch.transformer["pooled_projection_dim"]),
            "timestep": timesteps,
            "img_ids": torch.empty(tokens, 3),
            "txt_ids": torch.empty(arch.text_tokens, 3),
            "guidance": torch.full((2,), arch.guidance),
        }
    if arch.family == "sd3":
        model = SD3Transformer2DModel(**arch.transformer)
        return model, {
            "hidden_states": torch.empty(2, arch.transformer["in_channels"], h, w),
            "encoder_hidden_states": torch.empty(2, arch.text_tokens, arch.transformer["joint_attention_dim"]),
            "pooled_projections": torch.empty(2, arch.transformer["pooled_projection_dim"]),
            "timestep": timesteps,
        }
    model = UNet2DConditionModel(**arch.unet)
    inputs: dict[str, Any] = {
        "sample": torch.empty(2, 4, h, w),  # guidance: the prompt and the negative, one call
        "timestep": timesteps,
        "encoder_hidden_states": torch.empty(2, 77, model.config.cross_attention_dim),
    }
    if arch.xl:
        pooled = arch.unet["projection_class_embeddings_input_dim"] - 6 * arch.unet["addition_time_embed_dim"]
        inputs["added_cond_kwargs"] = {"text_embeds": torch.empty(2, pooled), "time_ids": torch.empty(2, 6)}
    return model, inputs


def flops_per_image(arch: Arch, unet_step: float, vae: float) -> float:
    return arch.steps * unet_step * (2 if arch.cfg else 1) + vae


def bench_dtype(arch: Arch, device: str) -> Any:
    """The dtype the benchmark renders in: the card's (``dtype_for``: bf16 where it is native, else fp16);
    on a CPU, half precision anyway so that a dry run takes the half-precision path too: bf16 for SD 1.5,
    fp16 for SDXL, whose VAE config asks for a float32 decode under fp16 (``force_upcast``)."""
    import torch

    from worker.render.models import dtype_for

    if device.startswith("cuda"):
        return dtype_for(device)
    return torch.float16 if arch.xl else torch.bfloat16


def build(arch: Arch, device: str, dtype: Any = None) -> Any:
    """A loaded model of ``arch`` with random weights, made on ``device`` and prepared as a worker prepares a CUDA
    model (``prepare_for_cuda``: on a CPU too, where its switches are harmless and its casts and layouts run)."""
    import torch

    from worker.render.models import LoadedModel, prepare_for_cuda, tiny_tokenizer

    started = time.perf_counter()
    dtype = dtype if dtype is not None else bench_dtype(arch, device)
    tokenizer = tiny_tokenizer()  # byte-level: its ids fit any CLIP vocabulary (and stand in for T5's)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in bf16 at once: SDXL's 3.5 B parameters never exist in fp32
    try:
        with torch.device(device):  # random init on the card: seconds, where SDXL on a CPU takes minutes
            pipe = _pipeline(arch, tokenizer)
    finally:
        torch.set_default_dtype(default_dtype)
    pipe.set_progress_bar_config(disable=True)
    prepare_for_cuda(pipe, dtype)
    return LoadedModel(
        pipe=pipe,
        model=f"{arch.name} (random weights)",
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - started,
    )


def _pipeline(arch: Arch, tokenizer: Any) -> Any:
    """``arch``'s pipeline, its modules made under the caller's device and default dtype."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch.family == "sd3":
        return StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**arch.transformer).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=AutoencoderKL(**arch.vae).eval(),
            text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**arch.text, **ids)).eval(),
            tokenizer=tokenizer,
            text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**arch.text_2, **ids)).eval(),
            tokenizer_2=tokenizer,
            text_encoder_3=T5EncoderModel(T5Config(**arch.t5, pad_token_id=tokenizer.pad_token_id)).eval(),
            tokenizer_3=tokenizer,  # pads to T5's 256 tokens as T5's would: the sequence the transformer reads
        )
    if arch.family == "flux":
        transformer = FluxTransformer2DModel(**arch.transformer).eval()
        return FluxPipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's: the shift grows with the image
                num_train_timesteps=1000,
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
            vae=AutoencoderKL(**arch.vae).eval(),
            text_encoder=CLIPTextModel(CLIPTextConfig(**arch.text, **ids)).eval(),
            tokenizer=tokenizer,
            text_encoder_2=T5EncoderModel(T5Config(**arch.t5, pad_token_id=tokenizer.pad_token_id)).eval(),
            tokenizer_2=tokenizer,  # pads to 512 tokens as T5's would
        )
    parts: dict[str, Any] = {
        "unet": UNet2DConditionModel(**arch.unet).eval(),
        "vae": AutoencoderKL(**arch.vae).eval(),
        "text_encoder": CLIPTextModel(CLIPTextConfig(**arch.text, **ids)).eval(),
        "tokenizer": tokenizer,
        "scheduler": DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        ),
    }
    if arch.xl:
        parts["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**arch.text_2, **ids)).eval()
        parts["tokenizer_2"] = tokenizer
        return StableDiffusionXLPipeline(**parts, add_watermarker=False)
    return StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
