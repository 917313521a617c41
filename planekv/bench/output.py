"""What every benchmark writes: its rows as JSON beside the run's metadata, and a Markdown table of the columns
any row fills."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any


def rows_to_json(rows: Sequence[Any], path: str, meta: dict[str, Any]) -> None:
    """``{"meta": meta, "rows": [each dataclass row as a dict]}`` to ``path``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=2)


def column_table(rows: Sequence[Any], columns: Sequence[str], cell: Callable[[Any, str], str]) -> str:
    """A Markdown table of the ``columns`` (attributes of the rows) that at least one row fills; ``cell(value,
    column)`` formats a value that is not None (None is an empty cell)."""
    cols = [c for c in columns if any(getattr(r, c) is not None for r in rows)]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "\n".join("| " + " | ".join("" if getattr(r, c) is None else cell(getattr(r, c), c) for c in cols)
                            + " |" for r in rows)
