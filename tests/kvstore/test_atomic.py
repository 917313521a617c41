"""planekv.kvstore.atomic: the file appears whole or not at all, a failed write leaves the target
as it was and no temporary file, missing directories are created, fsync is done when asked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from planekv.kvstore import atomic
from planekv.kvstore.atomic import atomic_write, atomic_write_bytes


def test_writes_the_bytes_and_creates_missing_directories(tmp_path: Path):
    target = tmp_path / "a" / "b" / "f.bin"
    assert atomic_write_bytes(target, b"hello") == target
    assert target.read_bytes() == b"hello"
    assert os.listdir(target.parent) == ["f.bin"]  # no temporary file left


def test_replaces_an_existing_file_whole(tmp_path: Path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old contents, longer than the new ones")
    atomic_write_bytes(target, memoryview(b"new"))
    assert target.read_bytes() == b"new"


def test_the_target_holds_the_old_file_until_the_rename(tmp_path: Path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    seen: list[bytes] = []

    def write(f) -> None:
        f.write(b"new, half")
        f.flush()
        seen.append(target.read_bytes())  # a reader during the write
        f.write(b" and the rest")

    atomic_write(target, write, tmp_prefix=".x-")
    assert seen == [b"old"]
    assert target.read_bytes() == b"new, half and the rest"


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_target_and_no_temporary_file(tmp_path: Path, exc: BaseException):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def write(f) -> None:
        f.write(b"partial")
        raise exc

    with pytest.raises(type(exc)):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_a_failed_first_write_creates_nothing(tmp_path: Path):
    def write(f) -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        atomic_write(tmp_path / "f.bin", write)
    assert os.listdir(tmp_path) == []


def test_a_failed_rename_removes_the_temporary_file(tmp_path: Path):
    target = tmp_path / "dir-in-the-way"
    (target / "child").mkdir(parents=True)  # os.replace of a file onto a non-empty directory fails
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"x")
    assert sorted(os.listdir(tmp_path)) == ["dir-in-the-way"]


def test_a_parent_that_is_a_file_is_a_clear_error(tmp_path: Path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises((FileExistsError, NotADirectoryError)):
        atomic_write_bytes(tmp_path / "file" / "f.bin", b"x")


def test_the_temporary_file_is_in_the_target_directory_with_the_prefix(tmp_path: Path):
    names: list[str] = []
    atomic_write(tmp_path / "f.bin", lambda f: names.extend(os.listdir(tmp_path)), tmp_prefix=".calib-")
    assert len(names) == 1 and names[0].startswith(".calib-")


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_of_the_file_and_the_directory_only_when_asked(tmp_path: Path, monkeypatch, fsync: bool):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    atomic_write_bytes(tmp_path / "f.bin", b"x", fsync=fsync)
    assert len(synced) == (2 if fsync else 0)  # the temporary file, then the directory
