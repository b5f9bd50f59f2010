"""Tiny LoRA adapters for the tiny model, made in a test: random non-zero weights on its UNet's
attention projections (and, when asked, its text encoder's), saved as safetensors under the names
diffusers loads (``unet.…lora_A/B``, ``text_encoder.…lora_A/B``).

Random A and B matrices (PEFT's ``init_lora_weights=False``) from a fixed seed: every machine
writes the same file, and the adapter changes the image (PEFT's default B=0 would not).  The UNet's
matrices come first from the seed, so a LoRA with a text encoder differs from the UNet-only one of
the same seed by its text encoder's weights alone.
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_lora(
    path: Path, *, seed: int = 0, rank: int = 4, text_encoder: bool = False, text_model_names: bool = False
) -> Path:
    """Write a LoRA for the ``tiny`` model's UNet (and its text encoder with ``text_encoder``) to
    ``path`` (a .safetensors file); returns it.  ``text_model_names``: the text encoder's keys under
    ``text_model.``, as in the LoRAs made before transformers 5 took that wrapper out of CLIPTextModel
    (most of those on the hub)."""
    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    from worker.render.models import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    layers: dict[str, dict[str, torch.Tensor]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe.unet.add_adapter(
            LoraConfig(
                r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"]
            ),
            adapter_name="made",
        )
        layers["unet_lora_layers"] = get_peft_model_state_dict(pipe.unet, adapter_name="made")
        if text_encoder:
            # PEFT's own injection, not transformers' add_adapter: that one refuses a peft below its
            # MIN_PEFT_VERSION, and the test of that refusal is the worker's load, not this file.
            inject_adapter_in_model(
                LoraConfig(
                    r=rank,
                    lora_alpha=rank,
                    init_lora_weights=False,
                    target_modules=["q_proj", "k_proj", "v_proj", "out_proj"],
                ),
                pipe.text_encoder,
                adapter_name="made",
            )
            state = get_peft_model_state_dict(pipe.text_encoder, adapter_name="made")
            prefix = "text_model." if text_model_names and not hasattr(pipe.text_encoder, "text_model") else ""
            layers["text_encoder_lora_layers"] = {prefix + key: value for key, value in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(path.parent, weight_name=path.name, **layers)
    return path


def make_transformer_lora(path: Path, model: str, *, seed: int = 0, rank: int = 4) -> Path:
    """Write a LoRA for a built-in transformer model's denoiser (``tiny-sd3``, ``tiny-flux``): random
    non-zero A and B on its attention projections, saved under the keys its pipeline's
    ``load_lora_weights`` reads (``transformer.…lora_A/B``); returns ``path``."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    from worker.render.models import build_tiny

    pipe = build_tiny(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe.transformer.add_adapter(
            LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"]),
            adapter_name="made",
        )
        layers = get_peft_model_state_dict(pipe.transformer, adapter_name="made")
    path.parent.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(path.parent, weight_name=path.name, transformer_lora_layers=layers)
    return path
