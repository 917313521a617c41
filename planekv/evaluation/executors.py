"""Which executor runs a job's units: this process (the default), or N workers of a registered executor.

``--workers N`` (N >= 1) runs the units on the executor registered as ``"ray"``; this package cannot import
Ray's (``planekv.orchestration.eval_workers``: orchestration builds on evaluation, not the other way round), so that
module registers itself with :func:`register_executor` when imported, which the ``planekv`` command does at start.
``python -m planekv.evaluation.<job> --workers N`` therefore refuses, naming the command that works.

A worker builds the same :class:`~planekv.evaluation.common.Setup` as the driver from a :class:`SetupRecipe`: the
model, and the driver's calibration itself (bytes, so that nodes need no shared file system), so that every worker
uses the driver's codec; it checks that its format id is the driver's.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..kvstore import Calibration
from .common import Setup, setup
from .units import Executor, Result, Unit, UnitFunction

log = logging.getLogger(__name__)

WORKERS_EXECUTOR = "ray"  # the executor --workers N uses
EXECUTOR_ARGUMENTS = ("workers", "address", "unit_timeout")  # where the work runs, not what it computes
UNIT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class SetupRecipe:
    """What a worker needs to build the driver's Setup."""

    model: str | None  # as load_model takes it; a local path made absolute
    calibration: bytes  # the driver's calibration artifact (Calibration.to_bytes)
    device: str
    codebook: str
    format_id: str  # the driver's, checked by build()

    @classmethod
    def of(cls, s: Setup, model: str | None, device: str, codebook: str) -> SetupRecipe:
        if model is not None and Path(model).exists():
            model = str(Path(model).resolve())
        return cls(model, s.calibration.to_bytes(), device, codebook, s.codec.format_id)

    def build(self) -> Setup:
        s = setup(self.model, Calibration.from_bytes(self.calibration), self.device, codebook=self.codebook)
        if s.codec.format_id != self.format_id:
            raise RuntimeError(f"this worker's format {s.codec.format_id} is not the driver's {self.format_id}: "
                               f"every node needs the same model ({self.model})")
        return s


ExecutorFactory = Callable[[SetupRecipe, int, str | None, float], Executor]
_EXECUTORS: dict[str, ExecutorFactory] = {}


def register_executor(name: str, factory: ExecutorFactory) -> None:
    """Make ``factory(recipe, workers, address, unit_timeout_s)`` the executor called ``name``."""
    _EXECUTORS[name] = factory


class InProcess:
    """Runs units one after another in this process, on the driver's Setup."""

    def __init__(self, s: Setup) -> None:
        self.setup = s

    def run(self, fn: UnitFunction, units: Sequence[Unit]) -> Iterator[tuple[Unit, Result]]:
        for unit in units:
            yield unit, fn(self.setup, unit.spec)

    def close(self) -> None:
        pass


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=0,
                   help="run the units on N Ray workers (`planekv eval ...` only; 0: in this process)")
    p.add_argument("--address", default=None,
                   help="with --workers: join this Ray cluster (host:port, 'auto', or 'stack' for the one "
                        "`planekv up` started) instead of starting one on this machine")
    p.add_argument("--unit-timeout", type=float, default=UNIT_TIMEOUT_S,
                   help="with --workers: give up when no unit finished for this many seconds")


def check_executor_arguments(args: argparse.Namespace) -> None:
    """Refuse bad --workers / --address before anything loads."""
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 1 (or 0: in this process), got {args.workers}")
    if args.address and not args.workers:
        raise ValueError("--address needs --workers N (N >= 1)")
    if args.workers and WORKERS_EXECUTOR not in _EXECUTORS:
        raise ValueError("--workers needs the Ray executor, which the `planekv` command loads: run "
                         "`planekv eval <job> ... --workers N` (python -m planekv.evaluation.<job> runs in "
                         "one process)")
    if args.unit_timeout <= 0:
        raise ValueError(f"--unit-timeout must be positive, got {args.unit_timeout}")


@contextlib.contextmanager
def open_executor(args: argparse.Namespace, s: Setup) -> Iterator[Executor]:
    """The executor of ``args`` (add_executor_arguments; --model, --device, --codebook): this process for
    --workers 0, else the registered executor's N workers, closed on exit."""
    check_executor_arguments(args)
    if not args.workers:
        yield InProcess(s)
        return
    recipe = SetupRecipe.of(s, args.model, args.device, args.codebook)
    executor = _EXECUTORS[WORKERS_EXECUTOR](recipe, args.workers, args.address, args.unit_timeout)
    try:
        yield executor
    finally:
        executor.close()
