"""FormatSpec: the identity of stored data (DESIGN section 5).

Everything that changes what a stored bit means is in here; ``format_id`` is a hash of the canonical
JSON. Data written under one format is never read under another: readers compare format ids and
raise :class:`FormatMismatch`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .codebook import CODEBOOKS
from .errors import FormatMismatch

LAYOUT_VERSION = 1
V_RUNS = (1, 2, 4, 8)
POSITION_MODES = ("rope-before-cache", "none")


@dataclass(frozen=True)
class FormatSpec:
    """Geometry, transform, calibration and layout of one model's PlaneKV cache."""

    model_id: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    calibration_id: str
    model_revision: str = "unknown"
    position: str = "rope-before-cache"  # keys are cached after RoPE
    rope_theta: float = 10000.0
    seed_k: int = 0x5EED_0001  # Hadamard signs shared by Q and K
    seed_v: int = 0x5EED_0002  # Hadamard signs of V
    codebook: str = "gaussian-lloyd-tree"
    width: int = 8  # W: bits (planes) stored per scalar
    page_size: int = 64  # P: tokens per page
    layout_version: int = LAYOUT_VERSION
    # planes per token run in a V page: 1 = plane-major ``[W][P][d/8]``; g = each token's planes in runs of
    # g rows, ``[W/g][P][g][d/8]`` (docs/DECISIONS.md: fewer row requests per deep token in the Value stage)
    v_run: int = 1

    def __post_init__(self) -> None:
        # 10000 and 10000.0 are one format: the canonical JSON must not depend on the number type
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        for name in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(
                f"n_q_heads ({self.n_q_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 (bytes of a plane row), got {self.head_dim}")
        if not 1 <= self.width <= 8:
            raise ValueError(f"width W must be in 1..8, got {self.width}")
        if self.page_size not in (64, 128):
            raise ValueError(f"page_size must be 64 or 128, got {self.page_size}")
        if self.codebook not in CODEBOOKS:
            raise ValueError(f"unknown codebook {self.codebook!r}; known: {CODEBOOKS}")
        if self.position not in POSITION_MODES:
            raise ValueError(f"unknown position mode {self.position!r}; known: {POSITION_MODES}")
        if self.v_run not in V_RUNS or self.width % self.v_run:
            raise ValueError(f"v_run must be one of {V_RUNS} and divide the width W = {self.width}, got {self.v_run}")
        if self.layout_version != LAYOUT_VERSION:
            raise ValueError(f"layout version {self.layout_version} unknown (this build: {LAYOUT_VERSION})")

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.n_q_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``v_run`` only where it is not 1 (it came after the first formats, whose ids stay)."""
        d = dataclasses.asdict(self)
        if d["v_run"] == 1:
            del d["v_run"]
        return d

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def format_id(self) -> str:
        """First 16 hex digits of sha256 over the canonical JSON."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FormatSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown FormatSpec fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> FormatSpec:
        return cls.from_dict(json.loads(text))

    def check(self, other_format_id: str, what: str = "data") -> None:
        """Raise FormatMismatch unless ``other_format_id`` is this format's id."""
        if other_format_id != self.format_id:
            raise FormatMismatch(
                f"{what} has format {other_format_id}, but the reader's format is {self.format_id}"
                f" ({self.model_id}, calibration {self.calibration_id}); re-encode it or open it"
                " with the FormatSpec it was written under"
            )
