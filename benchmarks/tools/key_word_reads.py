"""Key plane reads at 32-channel word granularity (a token-major packed layout) against the per-channel
logical bits, for three channel orders: as stored, by calibration sigma_K (fixed per head), and by the
query's own depths (the bound). Synthetic data as the tests build it; reference reader on the CPU
(docs/KERNEL_NOTES.md, the binary-MMA plan).

    PYTHONPATH=. python benchmarks/tools/key_word_reads.py
"""

from __future__ import annotations

import torch

from planekv.kvstore import Codec, PlaneKVCache, ReadPolicy
from planekv.kvstore.reference import readkv_decode
from planekv.kvstore.synthetic import make_synthetic


def word_cost(dep: torch.Tensor, order: torch.Tensor, word: int = 32) -> float:
    """Channel bits read when each word of ``word`` channels (in ``order``) is read to its deepest
    channel's depth: dep [..., C] per-channel depths, order [..., C] a permutation of the channels."""
    d = dep.gather(-1, order)
    return float(d.view(*d.shape[:-1], -1, word).amax(-1).sum() * word)


def main() -> None:
    for seed in (0, 1):
        syn = make_synthetic(n_tokens=1024, n_rows=8, n_layers=1, n_q_heads=32, n_kv_heads=8, head_dim=128,
                             seed=seed)
        codec = Codec(syn.spec, syn.calibration)
        cache = PlaneKVCache(syn.spec, 8)
        kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
        for b in range(8):
            cache.append(0, kc[:, :1024], vc[:, :1024], seq=b)
        q = syn.q[0].transpose(0, 1).contiguous()
        sig = syn.calibration.sigma_k[0]  # [Hkv, d]
        for rate, share in ((2.0, 0.875), (4.0, 0.75)):
            _, st = readkv_decode(q, cache, 0, codec, ReadPolicy.flexible(rate, share))
            dep = st.k_depths.long()  # [B, Hkv, d]
            logical = float(dep.sum())
            nat = torch.arange(dep.shape[-1]).expand_as(dep)
            by_sig = sig.argsort(-1, descending=True)[None].expand_as(dep)
            by_dep = dep.argsort(-1, descending=True)
            print(f"seed {seed} R={rate:g}: mean Key depth {dep.float().mean():.2f}; word reads / logical: "
                  f"stored order {word_cost(dep, nat) / logical:.2f}, by sigma_K "
                  f"{word_cost(dep, by_sig) / logical:.2f}, by the query's depths "
                  f"{word_cost(dep, by_dep) / logical:.2f}")


if __name__ == "__main__":
    main()
