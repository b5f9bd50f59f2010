"""Models from an allow-list, and an s3:// model fetched only after every key is checked."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from renderfleet.digests import listing_digest
from renderfleet.errors import ModelLoadError
from renderfleet.settings import Settings
from renderfleet.store import S3Store
from worker.render.models import (
    DIGEST_MARKER,
    check_model_keys,
    fetch_cached,
    fetch_s3_file,
    fetch_s3_model,
    model_allowed,
    split_s3_model,
)


def test_the_allow_list_admits_ids_folders_and_s3_prefixes_and_nothing_else(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "sd").mkdir(parents=True)
    allowed = Settings(allowed_models=f" tiny, org/model ,{models}, s3://bucket/models/").allowed_model_list
    assert allowed == ("tiny", "org/model", str(models), "s3://bucket/models/")
    for ok in ("tiny", "org/model", str(models / "sd"), "s3://bucket/models/sd", "s3://bucket/models/a/b"):
        assert model_allowed(ok, allowed), ok
    for refused in (
        "org/model2",
        "other/model",
        str(tmp_path / "elsewhere"),
        str(models / ".." / "x"),
        "s3://bucket/models2/sd",
        "s3://bucket/models/../secret",
        "s3://other/models/sd",
    ):
        assert not model_allowed(refused, allowed), refused
    assert model_allowed("anything/at-all", Settings().allowed_model_list)  # no list: any model


def test_a_bucket_with_no_prefix_is_refused() -> None:
    for uri in ("s3://bucket", "s3://bucket/", "s3:///prefix"):
        with pytest.raises(ModelLoadError, match="never a whole bucket"):
            split_s3_model(uri)
    assert split_s3_model("s3://bucket/models/sd/") == ("bucket", "models/sd")


@pytest.mark.parametrize("key", ["../escape.bin", "unet/../../x", "/abs/path", "a//b", "./x", "a\\b", "bad\x00key"])
def test_a_key_that_would_leave_the_model_folder_refuses_the_model_before_anything_is_written(
    tmp_path: Path, key: str
) -> None:
    dest = tmp_path / "cache" / "partial"
    dest.mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="refusing key"):
        check_model_keys("s3://b/m", [("model_index.json", 10), (key, 10)], dest, max_bytes=1000)
    assert list(dest.iterdir()) == []


def test_the_total_size_of_a_model_is_capped(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="RENDERFLEET_MODEL_MAX_BYTES"):
        check_model_keys("s3://b/m", [("a", 600), ("b", 500)], tmp_path, max_bytes=1000)
    files = check_model_keys("s3://b/m", [("unet/", 0), ("a", 600), ("unet/b", 400)], tmp_path, max_bytes=1000)
    assert files == [("a", tmp_path.resolve() / "a"), ("unet/b", tmp_path.resolve() / "unet" / "b")]


def test_an_s3_model_is_fetched_into_the_cache_and_a_bad_one_leaves_nothing(s3_bucket: str, tmp_path: Path) -> None:
    bucket = s3_bucket[len("s3://") :].split("/")[0]
    client = boto3.session.Session().client("s3")
    for key, body in (
        ("models/sd/model_index.json", b"{}"),
        ("models/sd/unet/config.json", b"{}"),
        ("models/big/weights", b"x" * 2000),
        ("models/evil/model_index.json", b"{}"),
        ("models/evil/a//b", b"x"),
    ):
        client.put_object(Bucket=bucket, Key=key, Body=body)
    cache = tmp_path / "models"

    def fetch(uri: str, dest: Path) -> None:
        fetch_s3_model(uri, dest, max_bytes=1000)

    folder = fetch_cached(f"s3://{bucket}/models/sd", cache_dir=cache, fetch=fetch)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        DIGEST_MARKER,
        "model_index.json",
        "unet/config.json",
    ]
    # the copy records the listing it was fetched from, as submit takes it (keys, sizes, ETags)
    listing = list(S3Store(bucket, "models/sd").tagged(""))
    assert (folder / DIGEST_MARKER).read_text() == listing_digest(listing)
    assert listing_digest(listing).startswith("s3-etags-sha256:")
    # the prefix rewritten: the cached copy stays until a refresh fetches the new one in its place
    client.put_object(Bucket=bucket, Key="models/sd/unet/config.json", Body=b'{"v": 2}')
    assert fetch_cached(f"s3://{bucket}/models/sd", cache_dir=cache, fetch=fetch) == folder
    assert (folder / "unet" / "config.json").read_bytes() == b"{}"
    assert fetch_cached(f"s3://{bucket}/models/sd", cache_dir=cache, fetch=fetch, refresh=True) == folder
    assert (folder / "unet" / "config.json").read_bytes() == b'{"v": 2}'
    assert (folder / DIGEST_MARKER).read_text() == listing_digest(S3Store(bucket, "models/sd").tagged(""))
    assert (folder / DIGEST_MARKER).read_text() != listing_digest(listing)
    assert folder.parent == cache
    for uri, why in (
        (f"s3://{bucket}/models/big", "MODEL_MAX_BYTES"),
        (f"s3://{bucket}/models/evil", "refusing key"),
        (f"s3://{bucket}", "never a whole bucket"),
    ):
        with pytest.raises(ModelLoadError, match=why):
            fetch_cached(uri, cache_dir=cache, fetch=fetch)
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no partial folder left behind


def test_an_s3_lora_is_one_file_fetched_under_its_name_within_the_size_cap(s3_bucket: str, tmp_path: Path) -> None:
    bucket = s3_bucket[len("s3://") :].split("/")[0]
    client = boto3.session.Session().client("s3")
    client.put_object(Bucket=bucket, Key="loras/style.safetensors", Body=b"x" * 100)
    client.put_object(Bucket=bucket, Key="loras/style.safetensors.bak", Body=b"y")  # a longer key: not it
    client.put_object(Bucket=bucket, Key="loras/huge.safetensors", Body=b"x" * 2000)

    def fetch(uri: str, dest: Path) -> None:
        fetch_s3_file(uri, dest, max_bytes=1000)

    folder = fetch_cached(f"s3://{bucket}/loras/style.safetensors", cache_dir=tmp_path, fetch=fetch)
    assert [p.name for p in folder.iterdir()] == ["style.safetensors"]
    assert (folder / "style.safetensors").read_bytes() == b"x" * 100
    with pytest.raises(ModelLoadError, match="MODEL_MAX_BYTES"):
        fetch_cached(f"s3://{bucket}/loras/huge.safetensors", cache_dir=tmp_path, fetch=fetch)
    with pytest.raises(ModelLoadError, match="no such object"):
        fetch_cached(f"s3://{bucket}/loras/none.safetensors", cache_dir=tmp_path, fetch=fetch)
