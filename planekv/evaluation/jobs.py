"""What every evaluation job runs on: the device, a line naming the machine, progress, JSON
results, and the ``python -m planekv.evaluation.<job>`` entry point (the Ray job entrypoint form).

The bottom of the evaluation package: it imports none of the jobs, so every job (calibration
included) and ``common`` can import it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def hardware() -> str:
    """One line naming the machine the numbers came from."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA), torch {torch.__version__}"
    cpu = "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} (CPU)"


def show_progress() -> bool:
    """Progress bars on a terminal, never in CI."""
    return sys.stderr.isatty() and not os.environ.get("CI")


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """tqdm on a terminal; otherwise log every item at INFO."""
    if show_progress():
        from tqdm.auto import tqdm

        yield from tqdm(items, total=total, desc=desc, leave=False)
        return
    for i, x in enumerate(items):
        log.info("%s %d/%s", desc, i + 1, total if total is not None else "?")
        yield x


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, default=str))
    return p


def job_main(module: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """``python -m planekv.evaluation.<job>`` (also what a Ray job entrypoint runs): parse, log, run."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)
