"""Baselines behind one interface (DESIGN section 7, "systems compared").

A system encodes one layer's K/V once (the write path) and then answers query rows:

    enc = system.encode(k, v, layer)                 # k, v [Hkv, T, d], model domain (K after RoPE)
    out, stats = system.attend(q, enc, lengths)      # q [Hq, M, d]; row m reads [starts[m], lengths[m])

``stats`` reports the logical read of every row in bits (ReadStats). Each system computes
attention in float32 over what it would actually have read, so quality differences come only
from the stored/read representation.

- Dense: fp16 (or bf16) K/V, read fully: 16 bits.
- FullReader: the PlaneKV tree code at a fixed depth b for every scalar, read fully: b bits.
- TurboQuant-style: Hadamard-sign rotation, per-token norm (fp16), b-bit Lloyd-Max code per
  rotated coordinate (a flat quantizer, not a tree): b bits + 16 bits per token vector.
- KIVI-b: K per channel in groups of 128 tokens, V per token in groups of 32 channels, asymmetric
  b-bit min-max with fp16 scale and zero point; the newest ``len mod 128`` tokens stay fp16.
- SparQ: top-r query channels (summed over the GQA group) of all keys at 16 bits, then exact
  attention over the top-k tokens, blended with the running mean of V by the approximate mass.
  At rate R: r = R d / 16 and k = R T / 32, so each half costs R T d bits.
- FP8: e4m3 with one scale per KV head (amax / 448), vLLM's production option: 8 bits.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch

from .codebook import lloyd_max_levels
from .codec import Codec
from .stats import ReadStats
from .transform import HadamardSign

KIVI_RESIDUAL = 128
KIVI_V_GROUP = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def row_mask(lengths: torch.Tensor, starts: torch.Tensor | None, n_tokens: int,
             device: torch.device | str) -> torch.Tensor:
    """[M, T] bool: row m reads tokens [starts[m], lengths[m])."""
    j = torch.arange(n_tokens, device=device)[None, :]
    mask = j < lengths.to(device)[:, None]
    if starts is not None:
        mask &= j >= starts.to(device)[:, None]
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
              starts: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Float32 attention: q [Hq, M, d], k/v [Hkv, T, d] -> [Hq, M, d]; GQA by repeat_kv order."""
    hq, m, d = q.shape
    hk, t, _ = k.shape
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().view(hk, g * m, d)
    logits = (qg @ k.float().transpose(1, 2)).view(hk, g, m, t) * scale
    mask = row_mask(lengths, starts, t, q.device)
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    return (p.view(hk, g * m, t) @ v.float()).view(hq, m, d)


def _n_tokens(lengths: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    n = lengths.to(torch.int64).cpu()
    if starts is not None:
        n = n - starts.to(torch.int64).cpu()
    return n.double()


def _uniform_stats(k_bits_per_scalar: float, v_bits_per_scalar: float, n_tok: torch.Tensor,
                   hk: int, d: int, extra_bits_per_token: float = 0.0) -> ReadStats:
    k = n_tok * hk * (d * k_bits_per_scalar + extra_bits_per_token)
    v = n_tok * hk * (d * v_bits_per_scalar + extra_bits_per_token)
    return ReadStats(k_bits=k, v_bits=v, tokens=n_tok, n_kv_heads=hk, head_dim=d)


class KVSystem(ABC):
    """One compared system: a write path (encode) and a read path (attend)."""

    name: str = "system"

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> Any: ...

    @abstractmethod
    def attend(self, q: torch.Tensor, enc: Any, lengths: torch.Tensor, starts: torch.Tensor | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, ReadStats]: ...

    @abstractmethod
    def capacity_bits(self, n_tokens: int, head_dim: int) -> float:
        """Stored bits per K/V scalar for a sequence of ``n_tokens`` (metadata included)."""

    def describe(self) -> dict[str, Any]:
        return {"system": self.name}


class _DequantSystem(KVSystem):
    """A system whose read is dense attention over dequantized K/V read in full."""

    k_bits: float
    v_bits: float
    token_bits: float = 0.0

    def attend(self, q, enc, lengths, starts=None, scale=None):  # type: ignore[override]
        k, v = enc
        out = attention(q, k, v, lengths, starts, scale)
        st = _uniform_stats(self.k_bits, self.v_bits, _n_tokens(lengths, starts), k.shape[0], k.shape[2],
                            self.token_bits)
        return out, st

    def capacity_bits(self, n_tokens: int, head_dim: int) -> float:
        return (self.k_bits + self.v_bits) / 2 + self.token_bits / head_dim


class Dense(_DequantSystem):
    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("Dense stores float16 or bfloat16")
        self.dtype = dtype
        self.name = "Dense " + ("fp16" if dtype == torch.float16 else "bf16")
        self.k_bits = self.v_bits = 16.0

    def encode(self, k, v, layer):
        return k.to(self.dtype).float(), v.to(self.dtype).float()


class FullReader(_DequantSystem):
    """Every scalar stored and read at the tree's depth b."""

    def __init__(self, codec: Codec, bits: int = 4) -> None:
        if not 1 <= bits <= codec.width:
            raise ValueError(f"bits must be in 1..{codec.width}")
        self.codec, self.bits = codec, bits
        self.name = f"Full Reader ({bits}-bit)"
        self.k_bits = self.v_bits = float(bits)

    def encode(self, k, v, layer):
        c = self.codec
        return (c.decode(c.encode_k(k, layer), self.bits, layer, "k"),
                c.decode(c.encode_v(v, layer), self.bits, layer, "v"))


class TurboQuant(_DequantSystem):
    """Hadamard-sign rotation + per-token norm + b-bit Lloyd-Max code per coordinate."""

    def __init__(self, bits: int = 4, seed: int = 1234) -> None:
        self.bits, self.seed = bits, seed
        self.name = f"TurboQuant-style ({bits}-bit)"
        levels, taus = lloyd_max_levels(bits)
        self._levels = torch.tensor(levels, dtype=torch.float32)
        self._taus = torch.tensor(taus, dtype=torch.float32)
        self.k_bits = self.v_bits = float(bits)
        self.token_bits = 16.0  # the fp16 norm of each token's K (and V) vector
        self._rots: dict[int, tuple[HadamardSign, HadamardSign]] = {}

    def _rot(self, d: int) -> tuple[HadamardSign, HadamardSign]:
        if d not in self._rots:
            self._rots[d] = (HadamardSign(d, self.seed), HadamardSign(d, self.seed + 1))
        return self._rots[d]

    def _quant(self, x: torch.Tensor, rot: HadamardSign) -> torch.Tensor:
        d = x.shape[-1]
        xt = rot.forward(x.float())
        norm = xt.norm(dim=-1, keepdim=True).to(torch.float16).float().clamp_min(1e-12)
        unit = xt * (math.sqrt(d) / norm)
        idx = torch.bucketize(unit, self._taus.to(x.device))
        return rot.inverse(self._levels.to(x.device)[idx] * (norm / math.sqrt(d)))

    def encode(self, k, v, layer):
        rk, rv = self._rot(k.shape[-1])
        return self._quant(k, rk), self._quant(v, rv)


class FP8(_DequantSystem):
    """float8 e4m3 with one scale per KV head (amax / 448 over the encoded tokens)."""

    def __init__(self) -> None:
        self.name = "FP8 e4m3 (per-head scale)"
        self.k_bits = self.v_bits = 8.0

    @staticmethod
    def _quant(x: torch.Tensor) -> torch.Tensor:
        scale = (x.float().abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp_min(1e-12)
        return (x.float() / scale).to(torch.float8_e4m3fn).float() * scale

    def encode(self, k, v, layer):
        return self._quant(k), self._quant(v)


def _minmax_quant(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Asymmetric min-max quantization along ``dim`` with fp16 scale and zero point."""
    mn = x.amin(dim, keepdim=True).to(torch.float16).float()
    mx = x.amax(dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((mx - mn) / levels).to(torch.float16).float().clamp_min(1e-8)
    q = ((x - mn) / scale).round().clamp(0, levels)
    return q * scale + mn


class KIVI(KVSystem):
    """KIVI-b: per-channel K (token groups of 128), per-token V (channel groups of 32), fp16
    residual window of the newest ``len mod 128`` tokens."""

    def __init__(self, bits: int = 2, residual: int = KIVI_RESIDUAL, v_group: int = KIVI_V_GROUP) -> None:
        if bits not in (2, 4, 8):
            raise ValueError("KIVI bits must be 2, 4 or 8")
        self.bits, self.residual, self.v_group = bits, residual, v_group
        self.name = f"KIVI-{bits}"

    def encode(self, k, v, layer):
        hk, t, d = k.shape
        r = self.residual
        full = t // r * r
        kq = k.float().clone()
        if full:
            kg = k.float()[:, :full].reshape(hk, full // r, r, d)
            kq[:, :full] = _minmax_quant(kg, 2, self.bits).reshape(hk, full, d)
        vg = v.float().reshape(hk, t, d // self.v_group, self.v_group)
        vq = _minmax_quant(vg, 3, self.bits).reshape(hk, t, d)
        return {"kq": kq, "vq": vq, "k": k.to(torch.float16).float(), "v": v.to(torch.float16).float()}

    def _quantized_upto(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.to(torch.int64) // self.residual * self.residual

    def attend(self, q, enc, lengths, starts=None, scale=None):  # type: ignore[override]
        hq, m, d = q.shape
        hk, t, _ = enc["k"].shape
        g = hq // hk
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        qg = q.float().view(hk, g * m, d)
        quant = self._quantized_upto(lengths.cpu())
        is_q = torch.arange(t, device=q.device)[None, :] < quant.to(q.device)[:, None]  # [M, T]
        lq = (qg @ enc["kq"].transpose(1, 2)).view(hk, g, m, t)
        lf = (qg @ enc["k"].transpose(1, 2)).view(hk, g, m, t)
        logits = torch.where(is_q, lq, lf) * scale
        p = torch.softmax(logits.masked_fill(~row_mask(lengths, starts, t, q.device), float("-inf")), -1)
        pq = (p * is_q).view(hk, g * m, t)
        pf = (p * ~is_q).view(hk, g * m, t)
        out = (pq @ enc["vq"] + pf @ enc["v"]).view(hq, m, d)
        # Bits: quantized tokens at b bits + fp16 metadata, the residual at 16 bits.
        n_tok = _n_tokens(lengths, starts)
        first = torch.zeros_like(quant) if starts is None else starts.to(torch.int64).cpu()
        nq = (quant - first).clamp_min(0).double()
        nf = n_tok - nq
        k_bits = hk * d * (nq * (self.bits + 32.0 / self.residual) + nf * 16.0)
        v_bits = hk * d * (nq * (self.bits + 32.0 / self.v_group) + nf * 16.0)
        return out, ReadStats(k_bits=k_bits, v_bits=v_bits, tokens=n_tok, n_kv_heads=hk, head_dim=d)

    def capacity_bits(self, n_tokens: int, head_dim: int) -> float:
        nq = n_tokens // self.residual * self.residual
        nf = n_tokens - nq
        k = nq * (self.bits + 32.0 / self.residual) + nf * 16.0
        v = nq * (self.bits + 32.0 / self.v_group) + nf * 16.0
        return (k + v) / (2 * max(n_tokens, 1))


class SparQ(KVSystem):
    """SparQ attention at a read rate R (bits per scalar); K and V stored in fp16."""

    def __init__(self, rate: float = 4.0) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = rate
        self.name = f"SparQ (R={rate:g})"

    def describe(self) -> dict[str, Any]:
        return {"system": self.name, "rate": self.rate}

    def encode(self, k, v, layer):
        return k.to(torch.float16).float(), v.to(torch.float16).float()

    def capacity_bits(self, n_tokens: int, head_dim: int) -> float:
        return 16.0

    def attend(self, q, enc, lengths, starts=None, scale=None):  # type: ignore[override]
        k, v = enc
        hq, m, d = q.shape
        hk, t, _ = k.shape
        g = hq // hk
        dev = q.device
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        n_tok = _n_tokens(lengths, starts)
        r = max(1, min(d, int(round(self.rate * d / 16))))
        k_sel = (self.rate * n_tok / 32).round().clamp(min=1).to(torch.int64)
        k_sel = torch.minimum(k_sel, n_tok.to(torch.int64))
        qg = q.float().view(hk, g, m, d)
        mask = row_mask(lengths, starts, t, dev)  # [M, T]

        # 1. top-r channels of |q| summed over the group; approximate scores from those channels.
        ch = (qg.abs().sum(1)).topk(r, dim=-1).indices  # [Hkv, M, r]
        keep = torch.zeros(hk, m, d, device=dev).scatter_(-1, ch, 1.0)[:, None]  # [Hkv, 1, M, d]
        q_r = qg * keep
        l1_ratio = q_r.abs().sum(-1, keepdim=True) / qg.abs().sum(-1, keepdim=True).clamp_min(1e-12)
        s_hat = (q_r.reshape(hk, g * m, d) @ k.transpose(1, 2)).view(hk, g, m, t)
        s_hat = s_hat / torch.sqrt(d * l1_ratio).clamp_min(1e-12)
        p_hat = torch.softmax(s_hat.masked_fill(~mask, float("-inf")), -1)

        # 2. top-k tokens by the group's approximate mass (k varies by row: take k_max, trim).
        k_max = int(k_sel.max())
        score = p_hat.sum(1).masked_fill(~mask, -1.0)  # [Hkv, M, T]
        top = score.topk(k_max, dim=-1).indices  # [Hkv, M, k_max]
        rank_ok = torch.arange(k_max, device=dev)[None, None, :] < k_sel.to(dev)[None, :, None]
        sel = torch.zeros(hk, m, t, device=dev, dtype=torch.bool)
        sel.scatter_(-1, top, rank_ok.expand(hk, m, k_max))
        sel &= mask[None]
        alpha = (p_hat * sel[:, None]).sum(-1, keepdim=True)  # [Hkv, G, M, 1]

        # 3. exact attention over the selected tokens, blended with mean V.
        logits = (qg.reshape(hk, g * m, d) @ k.transpose(1, 2)).view(hk, g, m, t) * scale
        p = torch.softmax(logits.masked_fill(~sel[:, None], float("-inf")), -1)
        y = (p.reshape(hk, g * m, t) @ v).view(hk, g, m, d)
        maskf = mask.float()
        vbar = (maskf @ v) / maskf.sum(-1, keepdim=True).clamp_min(1.0)  # [Hkv, M, d]
        out = (alpha * y + (1 - alpha) * vbar[:, None]).reshape(hq, m, d)
        k_bits = hk * (16.0 * r * n_tok + 16.0 * d * k_sel.double())
        v_bits = hk * (16.0 * d * k_sel.double() + 16.0 * d)
        return out, ReadStats(k_bits=k_bits, v_bits=v_bits, tokens=n_tok, n_kv_heads=hk, head_dim=d,
                              extra={"r": r, "k": k_sel})
