"""Tiny LoRA adapters for the tiny model, made in a test: random non-zero weights on its UNet's
attention projections, saved as safetensors under the names diffusers loads (``unet.…lora_A/B``).

Random A and B matrices (PEFT's ``init_lora_weights=False``) from a fixed seed: every machine
writes the same file, and the adapter changes the image (PEFT's default B=0 would not).
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_lora(path: Path, *, seed: int = 0, rank: int = 4) -> Path:
    """Write a LoRA for the ``tiny`` model's UNet to ``path`` (a .safetensors file); returns it."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    from worker.models import build_tiny_pipeline

    unet = build_tiny_pipeline().unet
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                        init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet.add_adapter(config, adapter_name="made")
    state = get_peft_model_state_dict(unet, adapter_name="made")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"unet.{key}": value.contiguous() for key, value in state.items()}, str(path))
    return path
