"""The folder store never reads, writes, lists or removes anything outside its root.

Anyone who can write to the folder can plant a symbolic link among a job's
objects: to a file (the embedded server's password, cloud credentials) or to
a folder (a home directory).  Through the store a link is no object: reads
see nothing, listings skip it, writes through a linked folder are refused,
and a delete removes the link itself, never what it points at.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from renderfleet.errors import StoreError
from renderfleet.store import TEMP_DIR, LocalStore

SECRET = b"redis://:hunter2-the-password@127.0.0.1:6379/0"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the store with a secret file and a sub-folder: what a link points at."""
    folder = tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    (folder / "server.json").write_bytes(SECRET)
    (folder / "000001.png").write_bytes(SECRET)
    (folder / "sub" / "deep.txt").write_bytes(SECRET)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    store.put("jobs/j-1/spec.json", b"{}")
    store.put("jobs/j-1/images/000000.png", b"png")
    return store


def test_a_linked_file_is_no_object_to_get_get_range_exists_or_download(
    store: LocalStore, outside: Path, tmp_path: Path
) -> None:
    (store.root / "jobs/j-1/images/000001.png").symlink_to(outside / "server.json")
    key = "jobs/j-1/images/000001.png"
    assert store.get(key) is None and store.get_range(key, 0, 10) is None and not store.exists(key)
    with pytest.raises(StoreError, match="no such object"):
        store.download(key, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    assert store.get("jobs/j-1/images/000000.png") == b"png"  # the real one beside it still reads


def test_a_linked_folder_is_no_folder_to_get_get_range_exists_or_download(
    store: LocalStore, outside: Path, tmp_path: Path
) -> None:
    (store.root / "jobs/j-2").symlink_to(outside)
    for key in ("jobs/j-2/000001.png", "jobs/j-2/server.json", "jobs/j-2/sub/deep.txt"):
        assert store.get(key) is None and store.get_range(key, 0, 10) is None and not store.exists(key)
        with pytest.raises(StoreError, match="no such object"):
            store.download(key, tmp_path / "copy")
    # a link deeper down, under a real job folder, the same
    (store.root / "jobs/j-1/checkpoints").symlink_to(outside)
    assert store.get("jobs/j-1/checkpoints/sub/deep.txt") is None


def test_listings_skip_linked_files_and_folders(store: LocalStore, outside: Path) -> None:
    (store.root / "jobs/j-1/images/000001.png").symlink_to(outside / "server.json")
    (store.root / "jobs/j-1/thumbs").symlink_to(outside)
    (store.root / "jobs/j-2").symlink_to(outside)
    expected = ["jobs/j-1/images/000000.png", "jobs/j-1/spec.json"]
    assert list(store.list("")) == expected and list(store.list("jobs/j-1/")) == expected
    assert list(store.list("jobs/j-1/images/")) == ["jobs/j-1/images/000000.png"]
    assert list(store.list("jobs/j-1/thumbs/")) == [] and list(store.list("jobs/j-2/")) == []
    assert list(store.list("jobs/j-2/sub/")) == []
    assert list(store.sized("jobs/")) == [("jobs/j-1/images/000000.png", 3), ("jobs/j-1/spec.json", 2)]
    assert list(store.folders("jobs/")) == ["j-1"] and list(store.folders("jobs/j-1/")) == ["images"]
    assert list(store.folders("jobs/j-2/")) == []


def test_a_write_through_a_linked_folder_is_refused_and_nothing_lands_outside(
    store: LocalStore, outside: Path, tmp_path: Path
) -> None:
    before = snapshot(outside)
    (store.root / "jobs/j-1/thumbs").symlink_to(outside)
    (store.root / "jobs/j-2").symlink_to(outside)
    src = tmp_path / "src.bin"
    src.write_bytes(b"planted")
    for write in (lambda key: store.put(key, b"planted"), lambda key: store.put_file(key, src)):
        for key in ("jobs/j-1/thumbs/000000.webp", "jobs/j-2/server.json", "jobs/j-2/sub/new.txt"):
            with pytest.raises(OSError, match="symbolic link") as err:
                write(key)
            assert err.value.errno == errno.ELOOP
    assert snapshot(outside) == before
    assert os.listdir(store.root / TEMP_DIR) == []  # no temp file left behind either


def test_a_write_refuses_a_linked_temp_folder(tmp_path: Path, outside: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / TEMP_DIR).symlink_to(outside)
    before = snapshot(outside)
    with pytest.raises(OSError, match="symbolic link"):
        store.put("a/b", b"x")
    assert snapshot(outside) == before and not (store.root / "a" / "b").exists()


def test_a_write_at_a_linked_name_replaces_the_link_not_its_target(store: LocalStore, outside: Path) -> None:
    (store.root / "jobs/j-1/images/000001.png").symlink_to(outside / "server.json")
    store.put("jobs/j-1/images/000001.png", b"new png")
    assert store.get("jobs/j-1/images/000001.png") == b"new png"
    assert not (store.root / "jobs/j-1/images/000001.png").is_symlink()
    assert (outside / "server.json").read_bytes() == SECRET


def test_delete_removes_a_link_never_its_target(store: LocalStore, outside: Path) -> None:
    before = snapshot(outside)
    (store.root / "jobs/j-1/images/000001.png").symlink_to(outside / "server.json")
    (store.root / "jobs/j-2").symlink_to(outside)
    store.delete("jobs/j-1/images/000001.png")
    store.delete("jobs/j-2/server.json")  # under a linked folder: no object, nothing to do
    store.delete("jobs/j-2/sub/deep.txt")
    assert not os.path.lexists(store.root / "jobs/j-1/images/000001.png")
    assert snapshot(outside) == before


def test_delete_prefix_never_walks_into_a_linked_folder(store: LocalStore, outside: Path) -> None:
    before = snapshot(outside)
    (store.root / "jobs/j-1/images/000001.png").symlink_to(outside / "server.json")
    (store.root / "jobs/j-1/thumbs").symlink_to(outside)
    (store.root / "jobs/j-2").symlink_to(outside)
    assert store.delete_prefix("jobs/j-2/") == 0  # the job's folder itself a link: the link goes
    assert not os.path.lexists(store.root / "jobs/j-2")
    assert store.delete_prefix("jobs/j-1/") == 2  # its two files; the links are no objects
    assert not os.path.lexists(store.root / "jobs/j-1")
    assert snapshot(outside) == before


def test_delete_prefix_under_a_linked_parent_folder_touches_nothing(tmp_path: Path, outside: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / "jobs").symlink_to(outside)
    (outside / "j-1").mkdir()
    (outside / "j-1" / "spec.json").write_bytes(SECRET)
    before = snapshot(outside)
    assert store.delete_prefix("jobs/j-1/") == 0 and store.delete_prefix("jobs/sub/") == 0
    assert snapshot(outside) == before


def test_a_fifo_planted_at_a_key_is_no_object_and_never_blocks_a_reader(store: LocalStore) -> None:
    os.mkfifo(store.root / "jobs/j-1/images/000001.png")
    got: list[object] = []
    reader = threading.Thread(
        target=lambda: got.extend(
            [
                store.get("jobs/j-1/images/000001.png"),
                store.get_range("jobs/j-1/images/000001.png", 0, 4),
                store.exists("jobs/j-1/images/000001.png"),
            ]
        ),
        daemon=True,
    )
    reader.start()
    reader.join(10)
    assert got == [None, None, False], "the read blocked on the FIFO"
    assert list(store.list("jobs/j-1/images/")) == ["jobs/j-1/images/000000.png"]


def test_a_root_that_is_itself_a_link_is_the_operators_choice_and_works(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "root-link").symlink_to(tmp_path / "real")
    store = LocalStore(tmp_path / "root-link")
    store.put("jobs/j-1/spec.json", b"{}")
    assert store.get("jobs/j-1/spec.json") == b"{}" and list(store.list("")) == ["jobs/j-1/spec.json"]
    assert (tmp_path / "real" / "jobs" / "j-1" / "spec.json").read_bytes() == b"{}"
    assert store.delete_prefix("jobs/j-1/") == 1 and list(store.list("")) == []
