"""Atomic file writes: a file appears whole under its name, or not at all.

The bytes go to a temporary file in the target's own directory (so the rename cannot cross file
systems), which is then renamed over the target with :func:`os.replace`. Readers see the old file
or the new one, never a partial one, and a write that fails or is interrupted leaves the target as
it was and removes its temporary file.

With ``fsync=True`` (the default) the temporary file is fsynced before the rename and the directory
after it, so once the call returns the new file survives a crash or power loss. With
``fsync=False`` a crash (of the machine, not the process) may lose the write or, on some file
systems, leave an empty file under the name; callers choose that for speed where the data can be
rebuilt.

A crash of the *process* mid-write can leave a temporary file behind (named ``<tmp_prefix>...``
in the target's directory); a caller that scans its directory may remove such files on start.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_PREFIX = ".tmp-"

Bytes = bytes | bytearray | memoryview


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, fsync: bool = True,
                 tmp_prefix: str = TMP_PREFIX) -> Path:
    """Create or replace ``path`` atomically with what ``write(f)`` writes to the open binary file
    ``f``; returns ``path``. The parent directories are created if missing. If ``write`` (or
    anything after it) raises, the temporary file is removed, the target is untouched, and the
    exception propagates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=tmp_prefix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: Bytes, *, fsync: bool = True,
                       tmp_prefix: str = TMP_PREFIX) -> Path:
    """Create or replace ``path`` atomically with ``data`` (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data), fsync=fsync, tmp_prefix=tmp_prefix)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory entries of ``path`` (created, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
