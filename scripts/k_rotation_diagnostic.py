"""Diagnostic for the (8,2) miss: does the shared Q/K Hadamard-sign rotation cost the Key allocator
its water-filling gain? Recalibrates with the K rotation replaced by the identity (V keeps its own),
then prints the dev perplexity of the flexible reader at (rate, K share) pairs, and the mean
log(AM/GM) of the per-channel Key importances (q~_c sigma_c)^2 (the allocation's gain grows with it).

    python scripts/k_rotation_diagnostic.py {rot,norot,blockN} N_WINDOWS RATE:KSHARE[,RATE:KSHARE...]

``blockN``: a block-diagonal rotation (Hadamard blocks of N channels, the same signs) for K, which
keeps part of the importances' spread while still mixing outliers within each block.

Not a format option: a diagnostic only (EVALUATION.md, follow-ups on the (8,2) miss).
"""
import json
import math
import sys
import time

import torch

from planekv.kvstore import transform
from planekv.kvstore.format import FormatSpec

torch.set_num_threads(2)
MODE = sys.argv[1]
if MODE == "norot" or MODE.startswith("block"):
    _init = transform.HadamardSign.__init__

    def _init_k(self, head_dim: int, seed: int) -> None:
        _init(self, head_dim, seed)
        if seed != FormatSpec.seed_k:
            return
        if MODE == "norot":
            self.signs = torch.ones(head_dim, dtype=self.signs.dtype)
            self.matrix = torch.eye(head_dim, dtype=torch.float64)
        else:
            nb = int(MODE[5:])
            blk = torch.block_diag(*[transform.hadamard_matrix(nb)] * (head_dim // nb))
            self.matrix = blk * self.signs[None, :]

    transform.HadamardSign.__init__ = _init_k

from planekv.evaluation.common import setup  # noqa: E402
from planekv.evaluation.perplexity import window_nll  # noqa: E402
from planekv.evaluation.texts import tokenize_text, windows  # noqa: E402
from planekv.kvstore import ReadPolicy, reference  # noqa: E402
from planekv.kvstore.reference import ReadKV  # noqa: E402
from planekv.models.hf import teacher_forced  # noqa: E402

AMGM: list[float] = []
_orig = reference.readkv_teacher_forced


def _tf(q, k, v, codec, layer, policy, *a, **kw):
    qt = codec.rot_k.forward(q.float())  # [Hq, N, d]
    hk = codec.spec.n_kv_heads
    _, sig = codec.stats(layer, "k")
    imp = (qt.view(hk, -1, qt.shape[1], qt.shape[2]) * sig[:, None, None, :]).pow(2).sum(1) + 1e-30
    AMGM.append(float((imp.mean(-1).log() - imp.log().mean(-1)).mean()))
    return _orig(q, k, v, codec, layer, policy, *a, **kw)


reference.readkv_teacher_forced = _tf

if __name__ == "__main__":
    nwin = int(sys.argv[2])
    pairs = [tuple(map(float, p.split(":"))) for p in sys.argv[3].split(",")]
    t0 = time.time()
    s = setup("smollm2", None, "cpu")
    print(json.dumps({"mode": MODE, "calibration_id": s.codec.calibration.calibration_id,
                      "calib_sec": round(time.time() - t0, 1)}), flush=True)
    ids = tokenize_text(s.lm.tokenizer, "mansfield_park")
    wins = windows(ids, 2048, nwin)
    for rate, ks in pairs:
        AMGM.clear()
        t0 = time.time()
        nll = n = 0
        for w in wins:
            with teacher_forced(ReadKV(s.codec, ReadPolicy.flexible(rate, ks))):
                a, b = window_nll(s.lm.model, w)
            nll += a
            n += b
        print(json.dumps({"mode": MODE, "rate": rate, "k_share": ks, "ppl": round(math.exp(nll / n), 4),
                          "log_am_gm_key_importance": round(sum(AMGM) / len(AMGM), 4),
                          "sec": round(time.time() - t0, 1)}), flush=True)
