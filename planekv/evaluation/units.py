"""A job's units: what they are, what runs them, and the journal that makes every unit count once.

A job (perplexity, passkey) is a list of independent :class:`Unit` s with stable keys; a *unit function*
``fn(setup, spec) -> result`` (JSON-able dict in, JSON-able dict out) computes one, in this process or in a worker
of an :class:`Executor` (``executors``). :func:`run_units` runs the units a :class:`Journal` does not hold yet,
appends each result to it as it arrives and returns every result in unit order, so that the job sums the same
numbers in the same order however many workers computed them.

The journal is ``<out>/<job>.units.jsonl``: a header line with the job's settings and their fingerprint, then one
line per finished unit ``{"key", "fingerprint", "result"}``, flushed and fsynced before the next is taken. A resumed
run keeps the units journaled under the same fingerprint (a unit journaled twice counts once; an unfinished last
line, from a process killed mid-write, is dropped) and refuses a journal of other settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..kvstore.atomic import atomic_write
from .jobs import progress

if TYPE_CHECKING:
    from .common import Setup

log = logging.getLogger(__name__)

Result = dict[str, Any]
UnitFunction = Callable[["Setup", dict[str, Any]], Result]  # a module-level function: workers import it by name
PARTIAL_EVERY = 5  # on_partial after every this many finished units


@dataclass(frozen=True)
class Unit:
    """One independent piece of a job: ``key`` names it within the job (stable across runs), ``spec`` is the
    JSON-able input of the job's unit function."""

    key: str
    spec: dict[str, Any]


class Executor(Protocol):
    """Runs units and yields each ``(unit, result)`` as it finishes (in any order); ``close`` releases workers."""

    def run(self, fn: UnitFunction, units: Sequence[Unit]) -> Iterator[tuple[Unit, Result]]: ...

    def close(self) -> None: ...


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A short hash of the settings (canonical JSON)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class Journal:
    """The finished units of one job in ``path`` (see the module docstring), for ``settings``: everything a unit's
    result depends on besides its spec (model, calibration, format, the job's options)."""

    def __init__(self, path: str | os.PathLike[str], settings: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.settings = json.loads(json.dumps(settings))  # as it reads back from the file
        self.fingerprint = fingerprint(self.settings)

    def start(self, resume: bool) -> dict[str, Result]:
        """Open the journal for appending. ``resume``: return the results an earlier run of the same settings
        journaled (key -> result), refusing a journal of other settings; otherwise (or with no journal yet)
        begin a new one, replacing any earlier journal, and return nothing."""
        if resume and self.path.is_file():
            return self._read()
        if resume:
            log.info("no journal at %s: nothing to resume, every unit runs", self.path)
        elif self.path.is_file():
            log.info("replacing the earlier journal %s (--resume continues one)", self.path)
        header = {"fingerprint": self.fingerprint, "settings": self.settings}
        atomic_write(self.path, lambda f: f.write((json.dumps(header) + "\n").encode()))
        return {}

    def append(self, key: str, result: Result) -> None:
        """One finished unit, on disk (fsynced) when this returns."""
        line = json.dumps({"key": key, "fingerprint": self.fingerprint, "result": result})
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _read(self) -> dict[str, Result]:
        raw = self.path.read_text(encoding="utf-8")
        lines = raw.split("\n")
        if lines[-1]:  # a last line without its newline: the write was cut short; drop it from the file too
            log.warning("%s: dropping an unfinished last line (a run stopped mid-write)", self.path)
            with self.path.open("r+", encoding="utf-8") as f:
                f.truncate(len(raw.encode()) - len(lines[-1].encode()))
        entries = [self._parse(i, line) for i, line in enumerate(lines[:-1], 1)]
        if not entries or "settings" not in entries[0]:
            raise ValueError(f"{self.path} does not start with a journal header; use another --out or run "
                             "without --resume")
        if entries[0]["fingerprint"] != self.fingerprint:
            raise ValueError(f"cannot resume from {self.path}: it holds units of other settings "
                             f"({_differences(entries[0]['settings'], self.settings)}); run without --resume "
                             "to start afresh, or use another --out")
        done: dict[str, Result] = {}
        for i, e in enumerate(entries[1:], 2):
            if e.get("fingerprint") != self.fingerprint or "key" not in e or "result" not in e:
                raise ValueError(f"line {i} of {self.path} is not a unit of this journal's settings")
            done.setdefault(e["key"], e["result"])  # a unit journaled twice (a retried unit) counts once
        return done

    def _parse(self, number: int, line: str) -> dict[str, Any]:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = None
        if not isinstance(entry, dict) or "fingerprint" not in entry:
            raise ValueError(f"line {number} of {self.path} is not a journal entry")
        return entry


def _differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    diff = [f"{k}: {before.get(k)!r} then, {now.get(k)!r} now" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k)]
    return "; ".join(diff)


def job_journal(out: str | os.PathLike[str], job: str, s: Setup, **options: Any) -> Journal:
    """``<out>/<job>.units.jsonl`` for ``job`` on the model, calibration and format of ``s`` with the job's
    ``options`` (those its units' results depend on)."""
    return Journal(Path(out) / f"{job}.units.jsonl", {
        "job": job, "model_id": s.lm.model_id, "model_revision": s.lm.revision,
        "calibration_id": s.calibration.calibration_id, "format_id": s.codec.format_id, **options})


def add_resume_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true",
                   help="keep the units an earlier run of the same settings finished (<job>.units.jsonl in --out) "
                        "and run the rest")


def run_units(units: Sequence[Unit], fn: UnitFunction, executor: Executor, journal: Journal | None = None,
              resume: bool = False, desc: str = "units",
              on_partial: Callable[[Mapping[str, Result]], None] | None = None) -> dict[str, Result]:
    """Every unit's result (key -> result, in the order of ``units``): those ``journal`` holds from an earlier
    run when ``resume``, the others computed by ``executor`` and journaled as they finish. ``on_partial``
    receives the results so far (finished units only) after every PARTIAL_EVERY units."""
    if resume and journal is None:
        raise ValueError("resume needs a journal")
    keys = [u.key for u in units]
    twice = sorted(k for k, n in Counter(keys).items() if n > 1)
    if twice:
        raise ValueError(f"{desc}: units {twice[:3]} come twice (a system, rate or text given twice?)")
    done = journal.start(resume) if journal is not None else {}
    todo = [u for u in units if u.key not in done]
    if resume:
        log.info("%s: %d of %d units kept from %s, %d to run", desc, len(units) - len(todo), len(units),
                 journal.path, len(todo))  # type: ignore[union-attr]
    for n, (unit, result) in enumerate(progress(executor.run(fn, todo), total=len(todo), desc=desc), 1):
        if journal is not None:
            journal.append(unit.key, result)
        done[unit.key] = result
        if on_partial is not None and n % PARTIAL_EVERY == 0:
            on_partial({k: done[k] for k in keys if k in done})
    missing = [k for k in keys if k not in done]
    if missing:
        raise RuntimeError(f"{desc}: the executor returned no result for {len(missing)} units ({missing[:3]} ...)")
    return {k: done[k] for k in keys}
