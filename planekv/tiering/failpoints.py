"""Failpoints: named places in the commit and delete protocols that a test can arm to fail there.

Unarmed (the normal case) :func:`hit` is one dict lookup on an empty dict. A test arms a point
in-process with :func:`armed` (a context manager) or, for a service run as a subprocess, with the
environment variable ``PLANEKV_FAILPOINTS`` read once at import::

    PLANEKV_FAILPOINTS="put.after_publish=kill,file.delete=oserror:EROFS"

Actions: ``kill`` (SIGKILL this process: no handler, no flush runs), ``oserror:<ERRNO>`` (raise
``OSError(errno.<ERRNO>)``, e.g. ENOSPC for a full disk, EROFS for a read-only tier) and ``error``
(raise :class:`FailpointError`). A suffix ``@N`` fires from the N-th hit of the point on
(``put.after_publish=kill@3``: the third put dies). Test hooks only: nothing in production arms them.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "PLANEKV_FAILPOINTS"

# The points, in protocol order (a typo in a test's name is refused rather than silently unarmed).
POINTS = (
    "put.after_file_write",  # the new frame is on the file tier; nothing published yet
    "put.after_publish",  # the listener (Redis index) has the block; not yet local, nothing evicted
    "put.during_evict",  # the block is committed; its victims are being evicted or spilled
    "delete.after_index",  # the index entry is gone; the file is not deleted yet
    "file.write",  # inside the file tier's write (before any byte is written)
    "file.delete",  # inside the file tier's delete
    "worker.decode_step",  # a PlaneWorker's generation, after each token (planekv.orchestration.worker)
)


class FailpointError(RuntimeError):
    """Raised by a failpoint armed with ``error``."""


_armed: dict[str, str] = {}
_hits: dict[str, int] = {}  # hits so far of each armed point
_from: dict[str, int] = {}  # the hit from which each armed point fires


def _check(name: str, action: str) -> None:
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
    if action not in ("kill", "error") and not (action.startswith("oserror:")
                                                 and hasattr(errno, action.split(":", 1)[1])):
        raise ValueError(f"failpoint action {action!r}: use kill, error or oserror:<ERRNO name>")


def arm(name: str, action: str) -> None:
    action, _, nth = action.partition("@")
    _check(name, action)
    if nth and (not nth.isdigit() or int(nth) < 1):
        raise ValueError(f"failpoint {name}: @{nth} must be a hit number >= 1")
    _armed[name], _hits[name], _from[name] = action, 0, int(nth or 1)


def disarm(name: str) -> None:
    _armed.pop(name, None)


@contextmanager
def armed(name: str, action: str) -> Iterator[None]:
    """Arm ``name`` with ``action`` for the duration of the block."""
    arm(name, action)
    try:
        yield
    finally:
        disarm(name)


def hit(name: str) -> None:
    """Fail here if ``name`` is armed; otherwise do nothing."""
    action = _armed.get(name) if _armed else None
    if action is None:
        return
    _hits[name] += 1
    if _hits[name] < _from[name]:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "error":
        raise FailpointError(f"failpoint {name} fired")
    code = getattr(errno, action.split(":", 1)[1])
    raise OSError(code, f"{os.strerror(code)} (failpoint {name})")


def arm_from_env(value: str | None = None) -> None:
    """Arm the points listed in ``value`` (default: ``$PLANEKV_FAILPOINTS``): ``name=action,...``."""
    value = os.environ.get(ENV, "") if value is None else value
    for item in filter(None, (s.strip() for s in value.split(","))):
        name, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}: {item!r} is not name=action")
        arm(name.strip(), action.strip())


arm_from_env()
