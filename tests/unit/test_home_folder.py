"""RENDERFLEET_HOME: a folder renderfleet creates is made 0700; one it did not
create is used only if it is the user's alone, and is never chmodded."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from renderfleet.embedded import ensure_embedded, private_dir
from renderfleet.errors import ConfigError


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that takes nothing away, so a test sees the modes renderfleet chose."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_a_folder_renderfleet_creates_is_made_0700(tmp_path: Path, open_umask: None) -> None:
    home = tmp_path / "a" / "home"
    assert private_dir(home, "RENDERFLEET_HOME") == home
    assert mode(home) == 0o700


@pytest.mark.parametrize(
    ("folder_mode", "why"),
    [
        (0o1777, "is group- or world-writable (mode 1777)"),  # like /tmp
        (0o777, "is group- or world-writable (mode 0777)"),
        (0o770, "is group- or world-writable (mode 0770)"),
        (0o702, "is group- or world-writable (mode 0702)"),
    ],
)
def test_a_shared_folder_is_refused_by_name_and_left_as_it_was(
    tmp_path: Path, open_umask: None, folder_mode: int, why: str
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, folder_mode)
    with pytest.raises(ConfigError) as err:
        private_dir(shared, "RENDERFLEET_HOME")
    text = str(err.value)
    assert text.startswith(f"RENDERFLEET_HOME: {shared} {why}: ") and "\n" not in text, text
    assert mode(shared) == folder_mode  # never chmodded
    with pytest.raises(ConfigError):
        ensure_embedded(shared)  # refused before any server starts or any file is written
    assert list(shared.iterdir()) == [] and mode(shared) == folder_mode


def test_a_folder_someone_else_owns_is_refused(tmp_path: Path) -> None:
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 4242, -1)
        owner = 4242
    else:
        theirs, owner = Path("/usr"), os.stat("/usr").st_uid  # root's: not ours to change
    before = mode(theirs)
    with pytest.raises(ConfigError) as err:
        private_dir(theirs, "RENDERFLEET_HOME")
    assert f"RENDERFLEET_HOME: {theirs} is not owned by you (its owner is uid {owner}" in str(err.value)
    assert mode(theirs) == before


def test_a_folder_of_ones_own_that_no_one_else_can_write_is_used_as_it_is(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o755)  # readable by others is the user's choice; server.json itself is 0600
    assert private_dir(mine, "RENDERFLEET_HOME") == mine and mode(mine) == 0o755


def test_a_file_is_not_a_home_folder(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match=f"RENDERFLEET_HOME: {path} is not a folder"):
        private_dir(path, "RENDERFLEET_HOME")
