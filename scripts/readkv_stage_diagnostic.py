"""Diagnostic for the (8,2) miss (EVALUATION.md, "Follow-ups on the (8,2) miss"): teacher-forced dev
perplexity of the flexible reader with one stage made exact, to split its loss between the stages.

    python scripts/readkv_stage_diagnostic.py CALIBRATION.pt N_WINDOWS RATE K_SHARE MODE[,MODE...]

Modes: ``dense`` (float32 attention), ``full`` (the reference reader itself), ``kexact`` (exact Keys,
Values at the flexible budget: the Value stage's error), ``vexact`` (Keys at the budget, exact Values:
the Key stage's error), ``sinkkN`` (the first N Keys exact, not paid for), ``earlyN`` (rows that read
at most N tokens get exact attention). Env ``POLKW`` (JSON) passes ReadPolicy options. Not a valid
reader at rate R (the exact parts are not counted): a diagnostic only. Window(s) of mansfield_park.
"""
import json
import math
import os
import sys
import time

import torch

from planekv.evaluation.common import setup
from planekv.evaluation.perplexity import window_nll
from planekv.evaluation.texts import tokenize_text, windows
from planekv.kvstore import ReadPolicy, reference
from planekv.kvstore.reference import ReadKV, _allocate, _row_budgets, row_mask
from planekv.models.hf import teacher_forced

torch.set_num_threads(2)
MODE = {"m": "full"}
orig_tf = reference.readkv_teacher_forced


def rows(q, kc, vc, k, v, codec, layer, policy, lengths, starts, scale, mode):
    spec = codec.spec
    hq, m, d = q.shape
    hk = spec.n_kv_heads
    g = hq // hk
    n_tok = lengths - starts
    t_max = int(lengths.max())
    dist = codec.tree.distortion
    table = codec.table("cpu")
    mu_k, sig_k = codec.stats(layer, "k")
    mu_v, sig_v = codec.stats(layer, "v")
    bk, bv = _row_budgets(policy, n_tok, d)
    qt = codec.rot_k.forward(q.float()).view(hk, g, m, d)
    qs = qt * sig_k[:, None, None, :]
    a = (qs * qs).sum(1).permute(1, 0, 2)
    mask = row_mask(lengths, starts, t_max, "cpu")
    if mode in ("kexact", "dense"):
        kk = k[:, :t_max].float()  # model domain; q.k invariant
        logits = q.float().view(hk, g, m, d) @ kk.transpose(1, 2)[:, None]
    else:
        t_dep = _allocate(a, bk, policy, dist, policy.min_depth_k, 1, None)
        k_codes = kc[:, :t_max].long()
        logits = (qt * mu_k[:, None, None, :]).sum(-1, keepdim=True).expand(hk, g, m, t_max).clone()
        t_perm = t_dep.permute(1, 0, 2)[:, None]
        for tau in t_dep.unique().tolist():
            if tau == 0:
                continue
            kz = table[tau][k_codes]
            logits += (qs * (t_perm == tau)) @ kz.transpose(1, 2)[:, None]
    if mode.startswith("sinkk"):
        ns = int(mode[5:])
        ex = q.float().view(hk, g, m, d) @ k[:, :ns].float().transpose(1, 2)[:, None]
        logits[..., :ns] = ex
    logits = (logits * scale).masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if mode in ("vexact", "dense"):
        out = p @ v[:, :t_max].float()[:, None]
        return out.reshape(hq, m, d)
    b = (p * p).sum(1).permute(1, 0, 2)
    valid = mask[:, None, :].expand(m, hk, t_max)
    s_dep = _allocate(b, bv, policy, dist, policy.min_depth_v, policy.v_packet, valid)
    v_codes = vc[:, :t_max].long()
    out = mu_v[:, None, None, :] * p.sum(-1, keepdim=True)
    s_perm = s_dep.permute(1, 0, 2)[:, None]
    acc = torch.zeros_like(out)
    for tau in s_dep.unique().tolist():
        if tau == 0:
            continue
        vz = table[tau][v_codes]
        acc += (p * (s_perm == tau)) @ vz[:, None]
    out = out + sig_v[:, None, None, :] * acc
    out = codec.rot_v.inverse(out).reshape(hq, m, d)
    if mode.startswith("early"):  # rows reading <= n tokens: exact attention
        ne = int(mode[5:])
        lg = (q.float().view(hk, g, m, d) @ k[:, :t_max].float().transpose(1, 2)[:, None]) * scale
        pe = torch.softmax(lg + torch.where(mask, 0.0, float("-inf")), -1)
        ex = (pe @ v[:, :t_max].float()[:, None]).reshape(hq, m, d)
        sel = (n_tok <= ne)[None, :, None]
        out = torch.where(sel, ex, out)
    return out


def tf(q, k, v, codec, layer, policy, scale=None, window=None, row_chunk=512):
    mode = MODE["m"]
    if mode == "full":
        return orig_tf(q, k, v, codec, layer, policy, scale, window, row_chunk)
    n = q.shape[1]
    kc, vc = codec.encode_k(k, layer), codec.encode_v(v, layer)
    lengths = torch.arange(1, n + 1)
    starts = torch.zeros_like(lengths)
    outs = []
    for s in range(0, n, row_chunk):
        e = min(n, s + row_chunk)
        outs.append(rows(q[:, s:e], kc[:, :e], vc[:, :e], k[:, :e], v[:, :e], codec, layer, policy,
                         lengths[s:e], starts[s:e], scale, mode))
    from planekv.kvstore.stats import ReadStats
    st = ReadStats(k_bits=torch.zeros(n).double(), v_bits=torch.zeros(n).double(), tokens=lengths.double(),
                   n_kv_heads=codec.spec.n_kv_heads, head_dim=codec.spec.head_dim, workspace_bytes=0)
    return torch.cat(outs, 1), st


reference.readkv_teacher_forced = tf

if __name__ == "__main__":
    calib, nwin, rate, ks = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    modes = sys.argv[5].split(",")
    s = setup("smollm2", calib, "cpu")
    ids = tokenize_text(s.lm.tokenizer, "mansfield_park")
    wins = windows(ids, 2048, nwin)
    kw = json.loads(os.environ.get("POLKW", "{}"))
    pol = ReadPolicy.flexible(rate, ks, 8, **kw)
    for mode in modes:
        MODE["m"] = mode
        t0 = time.time()
        nll = n = 0
        for w in wins:
            with teacher_forced(ReadKV(s.codec, pol)):
                a, b = window_nll(s.lm.model, w)
            nll += a
            n += b
        print(json.dumps({"mode": mode, "kw": kw, "rate": rate, "k_share": ks, "ppl": math.exp(nll / n),
                          "sec": round(time.time() - t0, 1)}), flush=True)
