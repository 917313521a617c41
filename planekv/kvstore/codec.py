"""Codec: transform, calibration and codebook (the Gaussian tree by default) put together (DESIGN section 1, steps 1-4).

Write path: ``x -> x~ = M x -> z = (x~ - mu) / sigma -> W-bit leaf code`` (uint8).
Read path: a code read at depth t reconstructs ``x~ = mu + sigma * table[t, code]``; depth 0 gives
``mu``. Only the top t bits of the code matter at depth t, so unread planes may hold anything.
"""

from __future__ import annotations

import torch

from .calibration import Calibration
from .codebook import make_codebook
from .errors import CalibrationError, FormatMismatch
from .format import FormatSpec
from .transform import HadamardSign


class Codec:
    """Encodes and reconstructs K/V for one FormatSpec and its calibration."""

    def __init__(self, spec: FormatSpec, calibration: Calibration) -> None:
        if calibration.calibration_id != spec.calibration_id:
            raise FormatMismatch(
                f"calibration {calibration.calibration_id} is not the format's calibration "
                f"{spec.calibration_id}")
        if (calibration.seed_k, calibration.seed_v) != (spec.seed_k, spec.seed_v):
            raise CalibrationError("calibration was computed with other transform seeds than the format's")
        geom = (spec.n_layers, spec.n_kv_heads, spec.head_dim)
        if (calibration.n_layers, calibration.n_kv_heads, calibration.head_dim) != geom:
            raise CalibrationError(
                f"calibration geometry {tuple(calibration.mu_k.shape)} != format geometry {geom}")
        self.spec = spec
        self.calibration = calibration
        self.tree = make_codebook(spec.codebook, spec.width)  # FormatSpec.codebook: the named codebook
        self.rot_k = HadamardSign(spec.head_dim, spec.seed_k)
        self.rot_v = HadamardSign(spec.head_dim, spec.seed_v)
        self._boundaries = self.tree.boundaries()
        self._table = self.tree.table()
        self._var_table = self.tree.variance_table()

    @property
    def width(self) -> int:
        return self.spec.width

    @property
    def format_id(self) -> str:
        return self.spec.format_id

    def table(self, device: torch.device | str) -> torch.Tensor:
        """Reconstruction table [W + 1, 2**W] (float32) on ``device``."""
        if self._table.device != torch.device(device):
            self._table = self._table.to(device)
        return self._table

    def variance_table(self, device: torch.device | str) -> torch.Tensor:
        """Conditional-variance table [W + 1, 2**W] (float32) on ``device``, laid out like
        :meth:`table` (``NestedCodebook.variance_table``)."""
        if self._var_table.device != torch.device(device):
            self._var_table = self._var_table.to(device)
        return self._var_table

    def stats(self, layer: int, kind: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, sigma) [n_kv_heads, head_dim] of ``kind`` 'k' or 'v' for ``layer``."""
        c = self.calibration
        if kind == "k":
            return c.mu_k[layer].to(device), c.sigma_k[layer].to(device)
        if kind == "v":
            return c.mu_v[layer].to(device), c.sigma_v[layer].to(device)
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")

    def _encode(self, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        rot = self.rot_k if kind == "k" else self.rot_v
        mu, sigma = self.stats(layer, kind, x.device)
        xt = rot.forward(x)  # [..., Hkv, T, d] float32
        z = (xt - mu[:, None, :]) / sigma[:, None, :]
        b = self._boundaries.to(x.device)
        # bucketize(right=False) counts thresholds strictly below z: bit = 1 iff z > threshold.
        return torch.bucketize(z.float(), b).to(torch.uint8)

    def encode_k(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        """Keys (after RoPE) [..., Hkv, T, d] -> W-bit codes [..., Hkv, T, d] (uint8)."""
        return self._encode(k, layer, "k")

    def encode_v(self, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Values [..., Hkv, T, d] -> W-bit codes [..., Hkv, T, d] (uint8)."""
        return self._encode(v, layer, "v")

    def reconstruct(self, codes: torch.Tensor, depth: torch.Tensor | int, layer: int, kind: str) -> torch.Tensor:
        """Transformed-domain values ``mu + sigma * table[depth, code]`` [..., Hkv, T, d] (float32).

        ``depth`` broadcasts against ``codes`` (per channel: [..., Hkv, 1, d]; per token:
        [..., Hkv, T, 1]).
        """
        mu, sigma = self.stats(layer, kind, codes.device)
        table = self.table(codes.device)
        depth_t = torch.as_tensor(depth, device=codes.device).long().expand_as(codes)
        z = table[depth_t, codes.long()]
        return mu[:, None, :] + sigma[:, None, :] * z

    def decode(self, codes: torch.Tensor, depth: torch.Tensor | int, layer: int, kind: str) -> torch.Tensor:
        """Back to the model's domain: inverse transform of :meth:`reconstruct` (float32)."""
        rot = self.rot_k if kind == "k" else self.rot_v
        return rot.inverse(self.reconstruct(codes, depth, layer, kind))
