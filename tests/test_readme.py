"""The README's Python examples that run on any machine run as written: the format, a cache and a decode read, then
tiering on the same data."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_cache_and_tiering_examples_run(capsys) -> None:
    blocks = _blocks()
    first = blocks[0]
    tiering = next(b for b in blocks if "TieredCache" in b)
    scope: dict = {}
    exec(compile(first, "README: the format, a cache and a decode read", "exec"), scope)
    exec(compile(tiering, "README: tiering", "exec"), scope)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("torch.Size([1, 8, 64])") and "bits read per scalar" in printed[0]
    assert printed[1].startswith("TierBytes(") and "of the bits asked for capped" in printed[1]
    assert scope["tiered"].length(0, 0) == 300 and scope["tally"].steps == 1
