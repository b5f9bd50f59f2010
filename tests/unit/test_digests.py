"""A folder model's digest: what the loader reads, the same on every copy of the same weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from renderfleet.digests import folder_digest


def write_model(folder: Path, unet: bytes = b"unet weights") -> Path:
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    (folder / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(unet)
    return folder


def test_two_copies_of_the_same_weights_have_one_digest_whatever_their_hidden_bookkeeping(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    # What `hf download --local-dir` leaves in each copy (a download time per file), a clone's .git,
    # a desktop's .DS_Store: never read by the loader, and different on every copy.
    meta = a / ".cache" / "huggingface" / "download" / "unet"
    meta.mkdir(parents=True)
    (meta / "diffusion_pytorch_model.safetensors.metadata").write_text("abc123\netag\n1764790000.1\n")
    (b / ".git").mkdir()
    (b / ".git" / "index").write_bytes(b"clone-specific")
    (b / "unet" / ".DS_Store").write_bytes(b"finder")
    assert folder_digest(a) == folder_digest(b)
    # the weights themselves still count: another file's bytes, another digest
    c = write_model(tmp_path / "c", unet=b"other weights")
    assert folder_digest(c) != folder_digest(a)


def test_weights_reached_through_a_linked_folder_count_and_a_link_loop_ends(tmp_path: Path) -> None:
    # A VAE shared between model folders by a link: the loader reads its weights through it.
    shared = tmp_path / "shared" / "vae"
    shared.mkdir(parents=True)
    (shared / "diffusion_pytorch_model.safetensors").write_bytes(b"vae weights")
    model = write_model(tmp_path / "model")
    (model / "vae").symlink_to(shared, target_is_directory=True)
    (shared / "back").symlink_to(model, target_is_directory=True)  # a loop: must not hang
    before = folder_digest(model)
    (shared / "diffusion_pytorch_model.safetensors").write_bytes(b"other vae weights")
    assert folder_digest(model) != before


def test_a_folder_model_submit_cannot_read_is_one_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from renderfleet import digests
    from renderfleet.api import Client
    from renderfleet.errors import InputError
    from renderfleet.settings import Settings

    model = write_model(tmp_path / "model")
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"

    def unreadable(folder: Path, **_: object) -> str:  # a file the workers' user may read, not the submitter
        raise PermissionError(13, "Permission denied", str(weights))

    monkeypatch.setattr(digests, "folder_digest", unreadable)
    with pytest.raises(InputError) as exc:
        Client(Settings(home=tmp_path / "home", store=str(tmp_path / "store"))).options(model=str(model))
    assert exc.value.problems == [
        f"--model {str(model)!r}: cannot read {weights} to record the model's digest: Permission denied"
    ]
