"""The evaluation texts (DESIGN section 7): five public-domain Austen novels shipped in ``data/``.

Roles are fixed: calibration northanger_abbey, dev (K/V split search) mansfield_park, test
pride_and_prejudice and sense_and_sensibility, passkey filler emma.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any

import torch

CALIBRATION_TEXT = "northanger_abbey"
DEV_TEXT = "mansfield_park"
TEST_TEXTS = ("pride_and_prejudice", "sense_and_sensibility")
FILLER_TEXT = "emma"
TEXTS = (CALIBRATION_TEXT, DEV_TEXT, *TEST_TEXTS, FILLER_TEXT)


def text_path(name: str) -> Path:
    """A shipped text by name, or any existing file path."""
    p = Path(name)
    if p.is_file():
        return p
    res = resources.files("planekv.evaluation") / "data" / f"{name}.txt"
    path = Path(str(res))
    if not path.is_file():
        raise FileNotFoundError(f"no text {name!r}; shipped: {TEXTS}, or give a file path")
    return path


def load_text(name: str) -> str:
    return text_path(name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=16)
def _tokenize(tok_id: int, tok: Any, name: str, max_tokens: int | None) -> torch.Tensor:
    text = load_text(name)
    if max_tokens is not None:
        text = text[: max_tokens * 8]  # ~4 characters per token in English prose: ample margin
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    return ids if max_tokens is None else ids[:max_tokens]


def tokenize_text(tok: Any, name: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids [N] of a text (the first ``max_tokens`` tokens, if given); cached per process."""
    return _tokenize(id(tok), tok, name, max_tokens)


def windows(ids: torch.Tensor, window: int, n_windows: int) -> list[torch.Tensor]:
    """``n_windows`` disjoint windows of ``window`` tokens, evenly spaced over ``ids`` (the first
    starts at 0). Raises if the text is too short."""
    n = ids.numel()
    if n_windows < 1 or window < 2:
        raise ValueError("need n_windows >= 1 and window >= 2")
    if n < n_windows * window:
        raise ValueError(f"text has {n} tokens; {n_windows} windows of {window} need more")
    stride = (n - window) // max(1, n_windows - 1) if n_windows > 1 else 0
    stride = max(stride, window)
    return [ids[i * stride: i * stride + window] for i in range(n_windows)]
