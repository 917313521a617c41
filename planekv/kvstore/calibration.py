"""Calibration statistics (DESIGN section 1, step 2) and their versioned artifact.

Per layer, KV head and channel: mean ``mu`` and scale ``sigma`` of the *transformed* Keys (after
RoPE) and of the transformed Values. Codes quantize ``z = (x~ - mu) / sigma``.

The artifact is one file written with ``torch.save`` holding plain tensors and JSON-able metadata
(loadable with ``weights_only=True``). ``calibration_id`` is a hash of the statistics and the
transform seeds, so two artifacts with the same id decode identically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .atomic import atomic_write
from .errors import CalibrationError
from .transform import HadamardSign

CALIBRATION_VERSION = 1
SIGMA_FLOOR = 1e-6  # a dead channel still gets a finite scale
_TENSORS = ("mu_k", "sigma_k", "mu_v", "sigma_v")


@dataclass
class Calibration:
    """Statistics [n_layers, n_kv_heads, head_dim] (float32) plus metadata."""

    mu_k: torch.Tensor
    sigma_k: torch.Tensor
    mu_v: torch.Tensor
    sigma_v: torch.Tensor
    seed_k: int
    seed_v: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = self.mu_k.shape
        if len(shape) != 3:
            raise CalibrationError(f"statistics must be [layers, kv_heads, head_dim], got {tuple(shape)}")
        for name in _TENSORS:
            t = getattr(self, name)
            if t.shape != shape:
                raise CalibrationError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            if not torch.isfinite(t).all():
                raise CalibrationError(f"{name} holds non-finite values")
            setattr(self, name, t.detach().to(torch.float32).cpu().contiguous())
        if (self.sigma_k <= 0).any() or (self.sigma_v <= 0).any():
            raise CalibrationError("sigma must be positive")

    @property
    def n_layers(self) -> int:
        return self.mu_k.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.mu_k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.mu_k.shape[2]

    @property
    def calibration_id(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps({"v": CALIBRATION_VERSION, "seed_k": self.seed_k, "seed_v": self.seed_v,
                             "shape": list(self.mu_k.shape)}).encode())
        for name in _TENSORS:
            h.update(getattr(self, name).numpy().tobytes())
        return h.hexdigest()[:16]

    def nbytes(self) -> int:
        """Bytes of the statistics themselves (counted in capacity)."""
        return sum(getattr(self, n).numel() * 4 for n in _TENSORS)

    # ---- artifact ----

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the artifact atomically (temp file, then rename; not fsynced: see planekv.kvstore.atomic)."""
        payload = {
            "format": "planekv-calibration",
            "version": CALIBRATION_VERSION,
            "calibration_id": self.calibration_id,
            "seed_k": self.seed_k,
            "seed_v": self.seed_v,
            "meta_json": json.dumps(self.meta, sort_keys=True),
            **{name: getattr(self, name) for name in _TENSORS},
        }
        # Saved through a file object: torch names the archive's records after a *path*'s stem (a
        # random temp name here, so the bytes would differ per save; a bare ".calib-x" is even
        # rejected), but "archive" for a file object, so equal statistics give equal bytes.
        return atomic_write(path, lambda f: torch.save(payload, f), fsync=False, tmp_prefix=".calib-")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        """Read and verify an artifact; raises CalibrationError on anything unexpected."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CalibrationError(f"no calibration artifact at {path}") from None
        except Exception as exc:  # torch raises many kinds on a corrupt file
            raise CalibrationError(f"{path} is not a readable calibration artifact: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != "planekv-calibration":
            raise CalibrationError(f"{path} is not a PlaneKV calibration artifact")
        if data.get("version") != CALIBRATION_VERSION:
            raise CalibrationError(
                f"{path} has calibration version {data.get('version')}; this build reads {CALIBRATION_VERSION}")
        missing = [k for k in (*_TENSORS, "seed_k", "seed_v", "meta_json", "calibration_id") if k not in data]
        if missing:
            raise CalibrationError(f"{path} lacks the fields {missing}")
        try:
            if not all(isinstance(data[name], torch.Tensor) for name in _TENSORS):
                raise TypeError("statistics must be tensors")
            meta = json.loads(data["meta_json"])
            if not isinstance(meta, dict):
                raise TypeError("meta_json must hold an object")
            calib = cls(**{name: data[name] for name in _TENSORS}, seed_k=int(data["seed_k"]),
                        seed_v=int(data["seed_v"]), meta=meta)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(f"{path} holds malformed fields: {exc}") from exc
        if calib.calibration_id != data["calibration_id"]:
            raise CalibrationError(f"{path}: statistics do not match the recorded calibration id")
        return calib

    def to_bytes(self) -> bytes:
        """The artifact as bytes (for upload to the control plane)."""
        with tempfile.TemporaryDirectory() as tmp:
            p = self.save(Path(tmp) / "c.pt")
            return p.read_bytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Calibration:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "c.pt"
            p.write_bytes(blob)
            return cls.load(p)


class CalibrationBuilder:
    """Streams K/V samples (untransformed, K after RoPE) into per-channel statistics.

    Sums are kept in float64, so a long calibration text costs O(layers x heads x d) memory.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, seed_k: int, seed_v: int) -> None:
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.seed_k, self.seed_v = seed_k, seed_v
        self._rot_k = HadamardSign(head_dim, seed_k)
        self._rot_v = HadamardSign(head_dim, seed_v)
        z = lambda: torch.zeros(self.shape, dtype=torch.float64)  # noqa: E731
        self._n = torch.zeros(n_layers, dtype=torch.float64)
        self._sk, self._sk2, self._sv, self._sv2 = z(), z(), z(), z()

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n_kv_heads, n_tokens, head_dim] (any float dtype)."""
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != self.shape[1] or k.shape[2] != self.shape[2]:
            raise CalibrationError(
                f"expected K and V of shape [{self.shape[1]}, tokens, {self.shape[2]}], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}")
        kt = self._rot_k.forward(k.detach().cpu().double())
        vt = self._rot_v.forward(v.detach().cpu().double())
        self._n[layer] += k.shape[1]
        self._sk[layer] += kt.sum(1)
        self._sk2[layer] += (kt * kt).sum(1)
        self._sv[layer] += vt.sum(1)
        self._sv2[layer] += (vt * vt).sum(1)

    def build(self, meta: dict[str, Any] | None = None) -> Calibration:
        if (self._n < 2).any():
            missing = [i for i, n in enumerate(self._n.tolist()) if n < 2]
            raise CalibrationError(f"layers {missing} saw fewer than 2 tokens")
        n = self._n[:, None, None]

        def stats(s: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            mu = s / n
            var = (s2 / n - mu * mu).clamp_min(0.0)
            return mu, var.sqrt().clamp_min(SIGMA_FLOOR)

        mu_k, sigma_k = stats(self._sk, self._sk2)
        mu_v, sigma_v = stats(self._sv, self._sv2)
        meta = dict(meta or {})
        meta.setdefault("n_tokens", int(self._n[0].item()))
        return Calibration(mu_k, sigma_k, mu_v, sigma_v, self.seed_k, self.seed_v, meta)


def calibrate(k: torch.Tensor, v: torch.Tensor, seed_k: int, seed_v: int,
              meta: dict[str, Any] | None = None) -> Calibration:
    """Statistics from whole samples k, v: [n_layers, n_kv_heads, n_tokens, head_dim]."""
    b = CalibrationBuilder(k.shape[0], k.shape[1], k.shape[3], seed_k, seed_v)
    for layer in range(k.shape[0]):
        b.add(layer, k[layer], v[layer])
    return b.build(meta)
