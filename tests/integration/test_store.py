"""The store's behaviour, the same for a local folder and for S3 over real HTTP (moto server).

Retry tests put a small fault-injecting HTTP proxy (or a closed port) between
the store and moto: no boto3 mocks anywhere.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import botocore.exceptions
import pytest
from boto3.s3.transfer import TransferConfig

from renderfleet.errors import ConfigError, RecordTooLarge, StoreError
from renderfleet.store import TEMP_DIR, TEMP_MARK, LocalStore, RetryHook, S3Store, Store, open_store, read_record
from testing.servers import FlakyS3Proxy, free_port

pytestmark = pytest.mark.integration

MB = 1 << 20


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """A fresh, empty store of each kind."""
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    url = request.getfixturevalue("s3_bucket")
    s3 = open_store(url)  # endpoint from AWS_ENDPOINT_URL, set by the fixture
    assert isinstance(s3, S3Store)
    # S3's smallest part is 5 MB: a 12 MB upload goes up in 3 parts.
    s3.transfer_config = TransferConfig(multipart_threshold=5 * MB, multipart_chunksize=5 * MB)
    return s3


# ---- the shared behaviour ----


def test_put_then_get_returns_the_same_bytes(store: Store) -> None:
    store.put("jobs/j1/spec.json", b'{"a": 1}', content_type="application/json")
    assert store.get("jobs/j1/spec.json") == b'{"a": 1}'


def test_a_ranged_read_is_clamped_to_the_object_whatever_the_offsets(store: Store) -> None:
    """A forged index's offsets (past the end, past 2**63, backwards) read what the object holds there:
    nothing, never an error or an allocation of the range's size."""
    store.put("a/wire", b"0123456789")
    assert store.get_range("a/wire", 2, 5) == b"234"
    assert store.get_range("a/wire", 8, 2**40) == b"89"
    assert store.get_range("a/wire", 9, 11) == b"9"
    for start, end in [(10, 12), (11, 2**40), (2**63, 2**64 - 1), (5, 3), (-3, 0)]:
        assert store.get_range("a/wire", start, end) == b"", (start, end)
    assert store.get_range("a/none", 2**63, 2**64 - 1) is None


def test_a_read_over_its_cap_is_refused_by_the_size_the_store_gives_and_never_an_error_for_less(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 45, item 10: the size is checked before the bytes are read (a file's fstat, GetObject's
    ContentLength, the body closed unread); a record over its cap is a RecordTooLarge, a bad record."""
    key = "jobs/j1/events/evt_1.json"
    store.put(key, b"x" * 2000)
    assert store.get(key, max_bytes=2000) == b"x" * 2000
    with pytest.raises(RecordTooLarge) as caught:
        store.get(key, max_bytes=1999)
    assert (caught.value.size, caught.value.cap) == (2000, 1999) and isinstance(caught.value, ValueError)
    found = store.get_tagged(key, max_bytes=2000)
    assert found is not None and found[0] == b"x" * 2000
    with pytest.raises(RecordTooLarge) as tagged:
        store.get_tagged(key, max_bytes=100)
    assert tagged.value.tag == found[1]  # what a conditional write over it needs, without its bytes
    assert store.get("jobs/j1/events/none.json", max_bytes=1) is None
    with caplog.at_level(logging.WARNING, logger="renderfleet.store"):
        assert read_record(store, key, 100) is None
    assert [r.getMessage() for r in caplog.records if "2000 bytes" in r.getMessage() and "cap" in r.getMessage()]


def test_a_sparse_gigabyte_in_the_folder_store_is_refused_unread(tmp_path: Path) -> None:
    """A sparse 1 GB file planted as a checkpoint and as an event record: refused by its fstat size,
    the peak memory of the process unmoved (a read would hold a gigabyte)."""
    import resource

    from renderfleet import limits, spec

    store = LocalStore(tmp_path / "store")
    planted = {spec.checkpoint_key("j1", 0, 0): limits.MAX_CHECKPOINT_BYTES}
    planted[spec.event_key("j1", "evt_big")] = limits.MAX_EVENT_RECORD_BYTES
    for key in planted:
        store.put(key, b"{}")
        os.truncate(tmp_path / "store" / key, 1 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the process's peak so far
    for key, cap in planted.items():
        with pytest.raises(RecordTooLarge, match="1073741824 bytes"):
            store.get(key, max_bytes=cap)
        with pytest.raises(RecordTooLarge) as caught:
            store.get_tagged(key, max_bytes=cap)
        assert caught.value.tag  # hashed in chunks
        assert read_record(store, key, cap) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # < 64 MiB more


def test_put_replaces_an_existing_object(store: Store) -> None:
    store.put("a/b", b"old")
    store.put("a/b", b"new")
    assert store.get("a/b") == b"new"


def test_put_new_writes_only_where_no_object_is(store: Store) -> None:
    key = "jobs/j/images/000000.png"
    tag = store.put_new(key, b"first")
    assert tag and store.get_tagged(key) == (b"first", tag)
    assert store.put_new(key, b"second") is None  # a late write never replaces what is there
    assert store.get(key) == b"first"


def test_replace_and_delete_act_only_on_the_object_they_name(store: Store) -> None:
    key = "jobs/j/images/000001.png"
    first = store.put_new(key, b"first")
    assert first is not None
    assert store.replace(key, b"mine", tag="0" * 32) is None and store.get(key) == b"first"
    second = store.replace(key, b"second", tag=first)
    assert second and second != first and store.get(key) == b"second"
    assert store.replace(key, b"third", tag=first) is None  # another write came between: not ours to replace
    assert not store.delete_tagged(key, first) and store.get(key) == b"second"
    assert store.delete_tagged(key, second) and not store.exists(key)
    assert not store.delete_tagged(key, second)  # gone: nothing to do
    assert store.replace(key, b"x", tag=second) is None and not store.exists(key)


def test_of_many_racing_put_news_exactly_one_lands(tmp_path: Path) -> None:
    # The folder store's own guarantee (a hard link fails on any name). On S3 it is S3's: of racing
    # If-None-Match: * writes one succeeds and the rest get 412. moto cannot stand in for that race: its
    # server checks for the key and then puts, unlocked (moto/s3/responses.py), so two racers may both
    # land there (seen once in a loaded run). S3's side is tested one write after another, above.
    store = open_store(str(tmp_path / "store"))
    key = "jobs/j/images/000002.png"
    with ThreadPoolExecutor(8) as pool:
        tags = list(pool.map(lambda i: store.put_new(key, f"writer {i}".encode()), range(8)))
    [winner] = [i for i, tag in enumerate(tags) if tag is not None]
    assert store.get(key) == f"writer {winner}".encode()


def test_put_new_onto_a_folder_or_a_link_refuses_as_a_plain_write_does(tmp_path: Path) -> None:
    # Neither is an object (a reader sees none there) nor can a write put one there: the caller's error,
    # as a plain put onto a folder raises. Taken for "another's object" the runner read none, tried again,
    # and gave the batch up as the store's error: a prompt that can never be stored went round for ever.
    store = LocalStore(tmp_path / "s")
    (tmp_path / "s" / "jobs" / "j" / "bad.png").mkdir(parents=True)
    (tmp_path / "s" / "jobs" / "j" / "link.png").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(IsADirectoryError):
        store.put("jobs/j/bad.png", b"x")
    for name in ("bad.png", "link.png"):
        with pytest.raises(OSError, match="is there, not a file"):
            store.put_new(f"jobs/j/{name}", b"x")
    assert not (tmp_path / "elsewhere").exists() and store.put_new("jobs/j/ok.png", b"x") is not None
    assert sorted(os.listdir(tmp_path / "s" / TEMP_DIR)) == []  # no temporary file left behind


def test_a_key_holding_the_folder_stores_old_temp_mark_round_trips(store: Store) -> None:
    key = f"jobs/j1/images/p{TEMP_MARK}1.png"
    store.put(key, b"png", content_type="image/png")
    assert store.exists(key) and store.get(key) == b"png"
    assert list(store.list("jobs/j1/images/")) == [key]


def test_get_of_a_missing_key_returns_none(store: Store) -> None:
    assert store.get("jobs/nope/spec.json") is None


def test_exists_only_after_put(store: Store) -> None:
    assert not store.exists("jobs/j1/images/000001.png")
    store.put("jobs/j1/images/000001.png", b"png")
    assert store.exists("jobs/j1/images/000001.png")
    assert not store.exists("jobs/j1/images")  # a "folder" is not an object


def test_list_returns_sorted_keys_under_a_prefix_even_one_ending_mid_name(store: Store) -> None:
    keys = [
        "jobs/a/checkpoints/000002/0.json",
        "jobs/a/checkpoints/000001/1.json",
        "jobs/a/checkpoints/000001/0.json",
        "jobs/ab/x",
        "jobs/b/y",
        "top",
    ]
    for key in keys:
        store.put(key, b"x")
    assert list(store.list("jobs/a/checkpoints/000001/")) == [
        "jobs/a/checkpoints/000001/0.json",
        "jobs/a/checkpoints/000001/1.json",
    ]
    assert list(store.list("jobs/a")) == sorted(k for k in keys if k.startswith("jobs/a"))
    assert list(store.list("jobs/a/checkpoints/00000")) == sorted(k for k in keys if "checkpoints" in k)
    assert list(store.list("")) == sorted(keys)
    assert list(store.list("nothing/here/")) == []


def test_list_returns_every_key_past_one_page_of_1000(store: Store) -> None:
    keys = [f"many/{i:05d}" for i in range(1100)]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: store.put(k, b"."), keys))
    store.put("other/0", b".")
    assert list(store.list("many/")) == keys


def test_put_file_and_download_roundtrip_a_12mb_file(store: Store, tmp_path: Path) -> None:
    data = os.urandom(12 * MB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.put_file("jobs/j1/prompts.jsonl.gz", src)
    dest = tmp_path / "out" / "deeper" / "big.bin"  # parents do not exist yet
    store.download("jobs/j1/prompts.jsonl.gz", dest)
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["big.bin"]  # no temp file left beside it
    if isinstance(store, S3Store):
        head = store.client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/jobs/j1/prompts.jsonl.gz")
        assert head["ETag"].strip('"').endswith("-3")  # went up as a 3-part multipart upload


def test_download_of_a_missing_key_raises_store_error(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="jobs/none/x"):
        store.download("jobs/none/x", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_locate_gives_a_user_facing_location(store: Store, tmp_path: Path) -> None:
    if isinstance(store, S3Store):
        assert store.locate("jobs/j1/images/a.png") == f"s3://{store.bucket}/rf-test/jobs/j1/images/a.png"
        assert store.url == f"s3://{store.bucket}/rf-test"
    else:
        assert store.locate("jobs/j1/images/a.png") == str(tmp_path / "store" / "jobs" / "j1" / "images" / "a.png")
        assert store.url == str(tmp_path / "store")


@pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../b", "a//b", "a/./b", "a\\b"])
def test_a_key_that_could_escape_the_root_is_refused(store: Store, key: str) -> None:
    with pytest.raises(ValueError, match="bad store key"):
        store.put(key, b"x")


# ---- local: atomic writes, nothing at open ----


def test_local_store_creates_its_folder_on_first_write_not_at_open(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "later"))
    assert not (tmp_path / "later").exists()
    assert list(store.list("")) == []
    store.put("a/b/c", b"x")
    assert (tmp_path / "later" / "a" / "b" / "c").read_bytes() == b"x"


def test_local_put_leaves_no_temp_file_and_list_skips_one_left_by_a_crash(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("jobs/j1/images/a.png", b"png")
    store.put_file("jobs/j1/images/b.png", tmp_path / "jobs" / "j1" / "images" / "a.png")
    assert sorted(os.listdir(tmp_path / "jobs" / "j1" / "images")) == ["a.png", "b.png"]
    assert os.listdir(tmp_path / TEMP_DIR) == []
    (tmp_path / TEMP_DIR / "abc123.tmp").write_bytes(b"half")  # a crashed writer's
    assert list(store.list("")) == ["jobs/j1/images/a.png", "jobs/j1/images/b.png"]
    assert list(store.list("jobs/")) == ["jobs/j1/images/a.png", "jobs/j1/images/b.png"]
    assert list(store.folders("")) == ["jobs"]


def test_local_keys_that_hold_the_old_temp_mark_are_listed_like_any_other(tmp_path: Path) -> None:
    # The folder store once wrote ".<name>.rf-tmp-<random>" beside the target and hid every name holding
    # ".rf-tmp-": a prompt id holding it was never listed (results: missing; resume: rendered again).
    store = LocalStore(tmp_path)
    names = [f"a{TEMP_MARK}b", f"x{TEMP_MARK}", "plain"]
    for name in names:
        store.put(f"jobs/j1/images/{name}.png", b"png")
    assert list(store.list("jobs/j1/images/")) == sorted(f"jobs/j1/images/{n}.png" for n in names)
    assert all(store.exists(f"jobs/j1/images/{n}.png") for n in names)


def test_local_keys_may_not_reach_into_the_temp_folder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for call in (
        lambda: store.put(f"{TEMP_DIR}/x", b"x"),
        lambda: store.get(f"{TEMP_DIR}/x"),
        lambda: list(store.list(f"{TEMP_DIR}/")),
    ):
        with pytest.raises(ValueError, match="writes in flight"):
            call()


def test_local_put_gives_the_file_the_umask_mode_not_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        LocalStore(tmp_path).put("a.png", b"png")
    finally:
        os.umask(old)
    assert (tmp_path / "a.png").stat().st_mode & 0o777 == 0o644


def test_local_reader_never_sees_a_half_written_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    payloads = [b"A" * (2 * MB), b"B" * (2 * MB)]
    store.put("obj", payloads[0])
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            store.put("obj", payloads[n % 2])
            n += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        seen = {store.get("obj") for _ in range(300)}
    finally:
        stop.set()
        writer.join()
    assert seen <= set(payloads)
    assert [k for k in store.list("") if k != "obj"] == []


# ---- open_store ----


def test_open_store_parses_s3_urls_without_touching_the_network() -> None:
    plain = open_store("s3://bucket")
    assert isinstance(plain, S3Store)
    assert (plain.bucket, plain.prefix, plain.url) == ("bucket", "", "s3://bucket")
    assert plain.locate("a/b") == "s3://bucket/a/b"
    nested = open_store("s3://bucket/some/prefix/")
    assert isinstance(nested, S3Store)
    assert (nested.bucket, nested.prefix, nested.url) == ("bucket", "some/prefix", "s3://bucket/some/prefix")
    assert nested._client_obj is None  # made on first use, not at open


def test_open_store_takes_anything_else_as_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = open_store("out/here")
    assert isinstance(rel, LocalStore)
    assert rel.url == str(tmp_path / "out" / "here")
    fileurl = open_store(f"file://{tmp_path}/x")
    assert isinstance(fileurl, LocalStore) and fileurl.url == str(tmp_path / "x")


@pytest.mark.parametrize("url", ["s3://", "s3:///prefix", "gs://bucket/x", ""])
def test_open_store_refuses_a_bad_url_naming_it(url: str) -> None:
    with pytest.raises(ConfigError, match="store URL"):
        open_store(url)


# ---- retries over real HTTP faults ----


@pytest.fixture
def bucket_url(s3_bucket: str, moto_server: Any) -> Iterator[tuple[str, str]]:
    """(bucket, moto endpoint) for a fresh bucket."""
    yield s3_bucket.removeprefix("s3://").split("/")[0], moto_server.endpoint_url


def _fast_s3(bucket: str, *, max_attempts: int, on_retry: RetryHook | None = None) -> S3Store:
    """An S3 store with a tiny backoff, so retry tests take milliseconds."""
    return S3Store(bucket, "rf-test", max_attempts=max_attempts, wait_multiplier=0.001, wait_max=0.01, on_retry=on_retry)


def _retry_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if r.name == "renderfleet.store" and r.levelno == logging.WARNING)


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [(503, "SlowDown", "throttled"), (500, "InternalError", "server"), (400, "RequestTimeout", "throttled")],
)
def test_a_transient_failure_is_retried_then_succeeds_and_each_retry_is_told_with_its_class(
    bucket_url: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    status: int,
    code: str,
    kind: str,
) -> None:
    bucket, moto = bucket_url
    retries: list[tuple[str, str]] = []
    with FlakyS3Proxy(moto, fail_first=2, status=status, code=code) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = _fast_s3(bucket, max_attempts=4, on_retry=lambda what, why: retries.append((what, why)))
        store.put("a/b", b"hello")
        assert proxy.hits == 3
        assert store.get("a/b") == b"hello"
    assert _retry_warnings(caplog) == 2
    assert retries == [("s3", kind)] * 2


def test_put_file_is_retried_after_a_throttled_upload(
    bucket_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bucket, moto = bucket_url
    src = tmp_path / "f"
    src.write_bytes(b"file body")
    with FlakyS3Proxy(moto, fail_first=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = _fast_s3(bucket, max_attempts=3)
        store.put_file("f", src)  # boto3 wraps the ClientError in S3UploadFailedError
        assert store.get("f") == b"file body"


def test_exhausted_retries_raise_store_error_naming_operation_and_key(
    bucket_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bucket, moto = bucket_url
    with FlakyS3Proxy(moto, fail_first=-1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = _fast_s3(bucket, max_attempts=3)
        with pytest.raises(StoreError, match=rf"S3 get s3://{bucket}/rf-test/jobs/x failed after 3 attempt") as info:
            store.get("jobs/x")
        assert proxy.hits == 3
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)
    assert _retry_warnings(caplog) == 2


def test_access_denied_raises_store_error_at_once(bucket_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, moto = bucket_url
    with FlakyS3Proxy(moto, fail_first=-1, status=403, code="AccessDenied") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store = _fast_s3(bucket, max_attempts=5)
        with pytest.raises(StoreError, match="AccessDenied"):
            store.put("a", b"x")
        with pytest.raises(StoreError, match="exists"):
            store.exists("a")
        assert proxy.hits == 2  # one each: no retries


def test_a_refused_connection_is_retried_then_raises_store_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    retries: list[tuple[str, str]] = []
    store = _fast_s3("bucket", max_attempts=3, on_retry=lambda what, why: retries.append((what, why)))
    with pytest.raises(StoreError, match="S3 list s3://bucket/rf-test/jobs/") as info:
        list(store.list("jobs/"))
    assert isinstance(info.value.__cause__, botocore.exceptions.EndpointConnectionError)
    assert _retry_warnings(caplog) == 2
    assert retries == [("s3", "connection")] * 2


def test_one_client_is_shared_by_many_threads(s3_bucket: str) -> None:
    store = cast(S3Store, open_store(s3_bucket))
    with ThreadPoolExecutor(16) as pool:
        clients = list(pool.map(lambda _: store.client, range(64)))
    assert all(c is clients[0] for c in clients)


@pytest.mark.parametrize("sse", ["AES256", "aws:kms"])
def test_objects_carry_the_encryption_and_storage_class_the_settings_ask_for(
    s3_bucket: str, sse: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from renderfleet.settings import load_settings

    store0 = cast(S3Store, open_store(s3_bucket))
    key_id = None
    if sse == "aws:kms":
        import boto3

        kms = boto3.session.Session().client("kms", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
        key_id = kms.create_key()["KeyMetadata"]["KeyId"]
        monkeypatch.setenv("RENDERFLEET_S3_KMS_KEY_ID", key_id)
    monkeypatch.setenv("RENDERFLEET_S3_SSE", sse)
    monkeypatch.setenv("RENDERFLEET_S3_STORAGE_CLASS", "STANDARD_IA")
    monkeypatch.setenv("RENDERFLEET_S3_ADDRESSING", "path")
    settings = load_settings()
    store = cast(S3Store, open_store(s3_bucket, settings.s3_options))
    assert store.client.meta.config.s3 == {"addressing_style": "path"}
    big = tmp_path / "source.txt"
    big.write_bytes(b"x" * 1024)
    store.put("jobs/j/images/a.png", b"png")
    store.put_file("jobs/j/source/prompts.txt", big)
    for key in ("rf-test/jobs/j/images/a.png", "rf-test/jobs/j/source/prompts.txt"):
        head = store0.client.head_object(Bucket=store.bucket, Key=key)
        assert head["ServerSideEncryption"] == sse
        assert head.get("StorageClass") == "STANDARD_IA"
        if key_id:
            assert key_id in head["SSEKMSKeyId"]
    assert store.get("jobs/j/images/a.png") == b"png"


def test_a_bad_s3_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from renderfleet.settings import load_settings

    monkeypatch.setenv("RENDERFLEET_S3_SSE", "rot13")
    with pytest.raises(ConfigError, match="RENDERFLEET_S3_SSE: must be AES256"):
        load_settings()


def test_folders_lists_one_level_with_one_delimited_listing(store: Store) -> None:
    for job in ("j-b", "j-a", "j-c"):
        store.put(f"jobs/{job}/spec.json", b"{}")
        store.put(f"jobs/{job}/images/000001.png", b"png")
    store.put("jobs/loose.json", b"{}")
    assert list(store.folders("jobs/")) == ["j-a", "j-b", "j-c"]
    assert list(store.folders("jobs/j-a/")) == ["images"]
    assert list(store.folders("nothing/")) == []
