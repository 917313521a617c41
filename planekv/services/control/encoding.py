"""How the control plane writes values into Redis: canonical JSON and timestamps."""

from __future__ import annotations

import json
import time
from typing import Any


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no spaces: equal documents give equal text (and sha256)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def timestamp() -> str:
    """Now, in seconds since the epoch, as the text stored in Redis (microseconds)."""
    return f"{time.time():.6f}"
