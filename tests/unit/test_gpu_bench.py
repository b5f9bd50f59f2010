"""bench/gpu_bench.py's arithmetic: FLOPs counted on the meta device, the card's peak, MFU."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from bench.gpu_bench import (
    SD15,
    SDXL,
    count_flops,
    flops_per_image,
    peak_flops,
    tiny,
)


def test_sd15_flops_counted_at_512_match_the_published_figures() -> None:
    unet_step, vae = count_flops(SD15)
    assert unet_step == pytest.approx(0.80e12, rel=0.03)  # per step per image; guidance doubles it
    assert vae == pytest.approx(2.5e12, rel=0.03)
    assert flops_per_image(SD15, unet_step, vae) == pytest.approx(25 * 2 * unet_step + vae)
    # 989 TFLOP/s over ~42.7 TFLOP an image: the ceiling of about 23 images per second
    assert 989e12 / flops_per_image(SD15, unet_step, vae) == pytest.approx(23, rel=0.05)


def test_sdxl_at_1024_costs_several_times_sd15_at_512() -> None:
    sd_unet, sd_vae = count_flops(SD15)
    xl_unet, xl_vae = count_flops(SDXL)
    assert xl_unet > 3 * sd_unet
    assert xl_vae > 4 * sd_vae  # four times the pixels, and attention grows faster than that


def test_the_tiny_variants_keep_their_family_and_are_cheap() -> None:
    for arch in (SD15, SDXL):
        small = tiny(arch)
        assert small.xl == arch.xl and (small.width, small.steps) == (64, 2)
        unet_step, vae = count_flops(small)
        assert 0 < unet_step < 1e9 and 0 < vae < 1e9


def test_the_peak_is_the_cards_bf16_dense_figure_by_name() -> None:
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA L40S") == 362e12  # not the L4's
    assert peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("x86_64 CPU") is None
    assert peak_flops("x86_64 CPU", 2.0) == 2e12
