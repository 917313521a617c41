"""Compile the Triton kernels for sm_90a on a machine without a GPU and report SASS statistics.

    python benchmarks/tools/compile_check.py [--sass-dir DIR]

Catches compile errors before device time is spent and shows registers, spills and shared memory
per kernel and configuration (ptxas -v) plus the instruction mix of each kernel's SASS.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from planekv.kernels import alloc2 as A2
from planekv.kernels import decode as K
from planekv.kernels import encode as E
from planekv.kernels import fp8 as F
from planekv.kernels import linear as L
from planekv.kernels import refine as R
from planekv.kernels.reader import MMA_WARPS, VALUE_MAXNREG

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)


def compile_one(fn, sig: dict[str, str], consts: dict, num_warps: int = 4, sass_dir: str | None = None, tag: str = "",
                maxnreg: int | None = None):
    full = dict(sig)
    for k in consts:
        full[k] = "constexpr"
    k = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=TARGET,
                       options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        open(ptx, "w").write(k.asm["ptx"])
        cubin = os.path.join(tmp, "k.cubin")
        res = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                             capture_output=True, text=True)
        info = " ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                        if "Used" in line or "spill" in line)
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True).stdout
    pat = r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)"
    ops = collections.Counter(m.split(".")[0] for m in re.findall(pat, sass))
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        open(os.path.join(sass_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", f"{fn.__name__}{tag}") + ".sass"), "w").write(sass)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed for {fn.__name__}{tag}: {res.stderr}")
    line = f"{fn.__name__}{tag}: {info}; smem {k.metadata.shared} B; top ops {ops.most_common(8)}"
    print(line)
    regs = re.search(r"Used (\d+) registers", info)
    RESULTS.append({"kernel": f"{fn.__name__}{tag}", "registers": int(regs.group(1)) if regs else None,
            "line": line})


P32, PI = "*i32", "*fp32"
RESULTS: list[dict] = []  # one record per kernel compiled by compile_one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass-dir")
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--geometries", default="32/8/128,9/3/64,4/1/256")
    ap.add_argument("--only", default="", help="comma-separated kernel names")
    ap.add_argument("--skip", default="", help="comma-separated kernel names not to compile")
    ap.add_argument("--all-radix-passes", action="store_true", help="compile passes 2..NPASS (default: 2, 3)")
    ap.add_argument("--json", help="write one record per compiled kernel here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    passes = tuple(range(2, K.NPASS.value + 1)) if args.all_radix_passes else (2, 3)
    recs = compile_all(args.geometries, args.num_warps, set(filter(None, args.only.split(","))), args.sass_dir,
                       radix_passes=passes, skip=set(filter(None, args.skip.split(","))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)


def compile_alloc2(hk: int, hg: int, d: int, ks_v: int, kspv: int, min_v: int, pk: int, nw: int, sd: str | None,
                   t: str, want, hq: int = 0, g2: int = 1) -> None:
    """The kernels of planekv.kernels.alloc2 (two-pass Value allocation) for one geometry and reader:
    with the full importance histogram, and (hq > 0) with the sampled one (the sample's histogram, the
    bracket that scales it, the candidates pass that computes the importances) and the candidates'
    histogram that the binned exact pass reads."""
    g = dict(USE_RATE=True, HKV=hk, HG=hg, D=d, W=8, MIN_V=min_v, PACKET=pk, KS=ks_v)
    imp = dict(HQ=hq, G=hq // hk if hq else 1, G2=g2, NSK_PAD=128, HEAD_WEIGHT=True)
    for sample in (1, 16) if hq else (1,):
        ts = t + ("-s" if sample > 1 else "")
        cb, cbp = (dict(CBINS=4096), dict(cbins_ptr=P32)) if sample > 1 else (dict(CBINS=0), {})
        if want(A2._v_bracket):
            compile_one(A2._v_bracket, dict(ihist_ptr=P32, len_ptr=P32, r_ptr=PI, cmeta_ptr=P32, RATE="fp64",
                                            BK="i32", BV_FIXED="i32", SLACK="fp32", ZS="fp32", **cbp),
                        dict(KS_PAD=kspv, SAMPLE=sample, **g, **cb), num_warps=4, sass_dir=sd, tag=ts)
        if want(A2._v_cand):
            extra = dict(logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI, hw_ptr=PI, NSK="i32") if sample > 1 else {}
            compile_one(A2._v_cand, dict(vimp_ptr=PI, len_ptr=P32, r_ptr=PI, cmeta_ptr=P32, cand_ptr=P32, TMAX="i32",
                                         RATE="fp64", BK="i32", BV_FIXED="i32", CAP="i32", **extra, **cbp),
                        dict(BLK=1024, KS_PAD=kspv, **g, **cb,
                             **(dict(FROM_LOGITS=True, **imp) if sample > 1 else {})),
                        num_warps=nw, sass_dir=sd, tag=ts)
        if sample > 1 and want(A2._v_exact):  # the binned exact pass
            compile_one(A2._v_exact, dict(hist_ptr=P32, len_ptr=P32, cmeta_ptr=P32, cand_ptr=P32, RATE="fp64",
                                          BK="i32", BV_FIXED="i32", **cbp), dict(CAP=65536, SMALL=4096, **g, **cb),
                        num_warps=8, sass_dir=sd, tag=ts)
        if sample > 1 and want(A2._v_exact_split):  # the binned exact pass over several programs per group
            compile_one(A2._v_exact_split, dict(hist_ptr=P32, len_ptr=P32, cmeta_ptr=P32, cand_ptr=P32, cbins_ptr=P32,
                                                keep_ptr=P32, RATE="fp64", BK="i32", BV_FIXED="i32"),
                        dict(CAP=65536, CH=4096, KEEP=4096, **g, **cb), num_warps=4, sass_dir=sd, tag=ts)
        if sample > 1 and want(A2._value_sample):
            compile_one(A2._value_sample, dict(logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI, len_ptr=P32, hw_ptr=PI,
                                               ihist_ptr=P32, TMAX="i32", NSK="i32"),
                        dict(HKV=hk, HG=hg, TOK=8192, SAMPLE=sample, **imp), num_warps=4, sass_dir=sd, tag=ts)
    if want(A2._v_exact):
        compile_one(A2._v_exact, dict(hist_ptr=P32, len_ptr=P32, cmeta_ptr=P32, cand_ptr=P32, RATE="fp64", BK="i32",
                                      BV_FIXED="i32"), dict(CAP=32768, CBINS=0, **g), num_warps=16, sass_dir=sd,
                    tag=t)


def compile_refine(hq: int, hk: int, hg: int, hgp: int, g: int, g2: int, d: int, radix_passes: tuple[int, ...],
                   nw: int, sd: str | None, t: str, want) -> None:
    """The kernels of planekv.kernels.refine for one geometry and reader."""
    if want(R._refine_score):
        compile_one(R._refine_score, dict(logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI, len_ptr=P32, qt_ptr=PI, sig_ptr=PI,
                                          kdep_ptr=P32, dist_ptr=PI, rkey_ptr=P32, rcost_ptr=P32, rhist_ptr=P32,
                                          scale="fp32", TMAX="i32", NSK="i32"),
                    dict(HQ=hq, HKV=hk, HG=hg, HG_PAD=hgp, G=g, G2=g2, NSK_PAD=128, D=d, W=8, BLK=1024),
                    num_warps=nw, sass_dir=sd, tag=t)
    for pas in (1, K.NPASS.value):
        if want(R._refine_select):
            compile_one(R._refine_select, dict(rhist_ptr=P32, rsel_ptr="*i64", rcost_ptr=P32, len_ptr=P32, BKR="i32"),
                        dict(PASS=pas, HKV=hk, HG=hg, HG_PAD=hgp), num_warps=1, sass_dir=sd, tag=f"{t}p{pas}")
    for pas in radix_passes:
        if want(R._refine_radix):
            compile_one(R._refine_radix, dict(rkey_ptr=P32, len_ptr=P32, rsel_ptr="*i64", rhist_ptr=P32, TMAX="i32"),
                        dict(PASS=pas, HKV=hk, HG=hg, HG_PAD=hgp, BLK=1024), num_warps=nw, sass_dir=sd,
                        tag=f"{t}p{pas}")
    if want(R._refine_ties):
        compile_one(R._refine_ties, dict(rkey_ptr=P32, len_ptr=P32, rsel_ptr="*i64", rtie_ptr=P32, TMAX="i32"),
                    dict(HKV=hk, HG=hg, BLK=1024), num_warps=nw, sass_dir=sd, tag=t)
    if want(R._refine_order):
        compile_one(R._refine_order, dict(rkey_ptr=P32, len_ptr=P32, rsel_ptr="*i64", rtie_ptr=P32, rcost_ptr=P32,
                                          rord_ptr="*i16", rcnt_ptr=P32, TMAX="i32"),
                    dict(HKV=hk, HG=hg, HG_PAD=hgp, BLK=1024, NT_PAD=K.next_pow2(hg * 32)),
                    num_warps=nw, sass_dir=sd, tag=t)
    if want(R._key_refine_f):
        compile_one(R._key_refine_f, dict(kb_ptr="*u8", pt_ptr=P32, len_ptr=P32, rord_ptr="*i16", rcnt_ptr=P32,
                                          qt_ptr=PI, sig_ptr=PI, base_ptr=PI, tabw_ptr=PI, logit_ptr=PI, scale="fp32",
                                          SLOTS="i32", TMAX="i32"),
                    dict(HQ=hq, HKV=hk, G=g, D=d, W=8, P=64, BLK=1024, TS=max(1, 1024 // d)), num_warps=nw,
                    sass_dir=sd, tag=t)
    if want(R._key_restat):
        compile_one(R._key_restat, dict(logit_ptr=PI, len_ptr=P32, mstat_ptr=PI, sstat_ptr=PI, TMAX="i32"),
                    dict(HQ=hq, HKV=hk, G=g, G2=g2, NTOK=1024), num_warps=nw, sass_dir=sd, tag=t)


def compile_all(geometries: str, nw: int = 4, only: set[str] | None = None, sd: str | None = None,
                radix_passes: tuple[int, ...] = (2, 3), skip: set[str] | None = None) -> list[dict]:
    """Compile every kernel (those in ``only`` if given, none in ``skip``) for each "Hq/Hkv/d" geometry
    (flexible, constrained, full-4 variants); returns one record per compiled kernel. Raises on the
    first kernel that does not compile."""
    only = only or set()
    skip = skip or set()
    RESULTS.clear()

    def want(fn) -> bool:
        return (not only or fn.__name__ in only) and fn.__name__ not in skip

    for geo in geometries.split(","):
        hq, hk, d = map(int, geo.split("/"))
        g = hq // hk
        gp = max(16, g)
        g2 = K.next_pow2(g)
        tag = f"[{hq}/{hk}/d{d}]"
        for name, hg, ks_k, min_k, ks_v, min_v, pk, fixed in (("flex", hk, 8, 0, 8, 0, 1, 0),
                                                               ("cons", 1, 7, 1, 3, 1, 2, 0),
                                                               ("full4", 1, 4, 4, 4, 4, 1, 4)):
            t = f"{tag}{name}"
            hgp = K.next_pow2(hg)
            kspk = K.next_pow2(ks_k)
            kspv = K.next_pow2(ks_v)
            # the Key channel list by depth segments / in channel order; lambda by bisection / radix passes
            for korder, radix in ((0, False), (1, False), (1, True)):
                if want(K._prep):
                    compile_one(K._prep, dict(qt_ptr=PI, sig_ptr=PI, mu_ptr=PI, r_ptr=PI, whi_ptr="*fp16",
                                              wlo_ptr="*fp16", wf_ptr=PI, base_ptr=PI, kdep_ptr=P32, kord_ptr=P32,
                                              kcnt_ptr=P32, hist_ptr=P32, count_k="i32", rhist_ptr=P32,
                                              ihist_ptr=P32, q_ptr="*fp16", sq_b="i32", sq_h="i32", sq_d="i32",
                                              mkT_ptr=PI),
                                dict(HQ=hq, HKV=hk, HG=hg, G=g, D=d, KS=ks_k, KS_PAD=kspk, MIN_K=min_k, HG_PAD=hgp,
                                     RHW=0 if fixed else hgp * R.HIST_STRIDE_R, TWO_PASS=not fixed, KORDER=korder,
                                     RADIX=radix, QROWS=max(16, K.next_pow2(hg * g))),
                                num_warps=8, sass_dir=sd, tag=f"{t}-k{korder}" + ("-radix" if radix else ""))
            if name != "cons" and want(K._key_stage):
                compile_one(K._key_stage, dict(kw_ptr=P32, pt_ptr=P32, len_ptr=P32, kdep_ptr=P32, whi_ptr="*fp16",
                                               wlo_ptr="*fp16", base_ptr=PI, tab_ptr=P32, spread_ptr="*i64",
                                               logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI, scale="fp32", SLOTS="i32",
                                               TMAX="i32"),
                            dict(HQ=hq, HKV=hk, G=g, G_PAD=gp, D=d, W=8, P=64, PPK=4), num_warps=nw,
                            sass_dir=sd, tag=t)
            if name != "cons" and want(K._key_stage_t8):
                compile_one(K._key_stage_t8, dict(kb_ptr="*u8", pt_ptr=P32, len_ptr=P32, kdep_ptr=P32,
                                                  whi_ptr="*fp16", wlo_ptr="*fp16", base_ptr=PI, tabr_ptr=P32,
                                                  logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI, scale="fp32",
                                                  SLOTS="i32", TMAX="i32"),
                            dict(HQ=hq, HKV=hk, G=g, G_PAD=gp, D=d, W=8, P=64, PPK=4), num_warps=nw,
                            sass_dir=sd, tag=t)
            # the FMA Key stage: both walks of 1024-token programs, and the small steps' 128-token
            # programs that decode 4 channels at a time
            for kloop, ppk, ch in ((0, 16, 1), (1, 16, 1), (0, 2, 4)):
                if name != "cons" and want(K._key_stage_f):
                    compile_one(K._key_stage_f, dict(kb_ptr="*u8", pt_ptr=P32, len_ptr=P32, kord_ptr=P32, kcnt_ptr=P32,
                                                     wf_ptr=PI, base_ptr=PI, tabf_ptr=PI, logit_ptr=PI,
                                                     mstat_ptr=PI, sstat_ptr=PI, scale="fp32", SLOTS="i32",
                                                     TMAX="i32"),
                                dict(HQ=hq, HKV=hk, G=g, D=d, W=8, P=64, PPK=ppk, KLOOP=kloop, CH=ch),
                                num_warps=max(1, min(nw, ch * ppk * 64 // 256)), sass_dir=sd,
                                tag=f"{t}-k{kloop}" + (f"c{ch}" if ch > 1 else ""))
            vc = dict(D=d, W=8, BLK=1024, KS=ks_v, KS_PAD=kspv, MIN_V=min_v, PACKET=pk)
            if not fixed:  # the Key-refinement stage (both readers)
                compile_refine(hq, hk, hg, hgp, g, g2, d, radix_passes, nw, sd, t, want)
            if not fixed:
                if want(K._value_hist):
                    for two_pass in (False, True):
                        compile_one(K._value_hist, dict(logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI, len_ptr=P32,
                                                        r_ptr=PI, vimp_ptr=PI, hist_ptr=P32, hw_ptr=PI, ihist_ptr=P32,
                                                        TMAX="i32", NSK="i32", RATE="fp64", BK="i32", BV_FIXED="i32"),
                                    dict(HQ=hq, HKV=hk, HG=hg, G=g, G2=g2, NSK_PAD=128, BLK=1024, KS=ks_v,
                                         KS_PAD=kspv, HEAD_WEIGHT=True, TWO_PASS=two_pass, USE_RATE=True, D=d,
                                         W=8, MIN_V=min_v, PACKET=pk, FUSED=not two_pass,
                                         HWIN=256 if two_pass else 0, RHIST=1),
                                    num_warps=nw, sass_dir=sd, tag=t + ("-2pass" if two_pass else ""))
                for pas in radix_passes:
                    for gated in (False, True):
                        if want(K._value_radix):
                            compile_one(K._value_radix, dict(vimp_ptr=PI, len_ptr=P32, r_ptr=PI, hist_ptr=P32,
                                                             cmeta_ptr=P32, TMAX="i32", RATE="fp64", BK="i32",
                                                             BV_FIXED="i32", NBLK="i32"),
                                        dict(USE_RATE=True, PASS=pas, HKV=hk, HG=hg, GATED=gated, FUSED=True, RHIST=1,
                                             **vc),
                                        num_warps=nw, sass_dir=sd, tag=f"{t}p{pas}" + ("g" if gated else ""))
                if want(K._value_radix):  # the gated pass 1 (two-pass allocation's fall back)
                    compile_one(K._value_radix, dict(vimp_ptr=PI, len_ptr=P32, r_ptr=PI, hist_ptr=P32, cmeta_ptr=P32,
                                                     TMAX="i32", RATE="fp64", BK="i32", BV_FIXED="i32", NBLK="i32"),
                                dict(USE_RATE=True, PASS=1, HKV=hk, HG=hg, GATED=True, FUSED=True, RHIST=1, **vc),
                                num_warps=nw, sass_dir=sd, tag=f"{t}p1")
                compile_alloc2(hk, hg, d, ks_v, kspv, min_v, pk, nw, sd, t, want, hq=hq, g2=g2)
                for gate in (False, True) if want(K._value_ties) else ():  # gated: the two-pass allocation's
                    compile_one(K._value_ties, dict(vimp_ptr=PI, len_ptr=P32, r_ptr=PI, hist_ptr=P32, tie_ptr=P32,
                                                    TMAX="i32", RATE="fp64", BK="i32", BV_FIXED="i32",
                                                    **({"cmeta_ptr": P32} if gate else {})),
                                dict(USE_RATE=True, HKV=hk, HG=hg, TIE_GATE=gate, **vc), num_warps=nw, sass_dir=sd,
                                tag=t + ("-gated" if gate else ""))
            if not fixed and want(K._value_stage_c):
                compile_one(K._value_stage_c, dict(vb_ptr="*u8", pt_ptr=P32, len_ptr=P32, logit_ptr=PI, mstat_ptr=PI,
                                                   sstat_ptr=PI, vimp_ptr=PI, r_ptr=PI, hist_ptr=P32, tie_ptr=P32,
                                                   tab_ptr=P32, tabr_ptr=P32, vdep_ptr="*i8", vord_ptr="*i16",
                                                   part_ptr=PI, SLOTS="i32", TMAX="i32", NSK="i32", RATE="fp64",
                                                   BK="i32", BV_FIXED="i32"),
                            dict(USE_RATE=True, HQ=hq, HKV=hk, HG=hg, G=g, G_PAD=gp, NSK_PAD=128, P=64, VG=1,
                                 NT_PAD=K.next_pow2(hg * 32), T8=d >= 256, **vc),
                            num_warps=nw, sass_dir=sd, tag=t)
            if not fixed and want(K._radix_select):
                compile_one(K._radix_select, dict(hist_ptr=P32, len_ptr=P32, cmeta_ptr=P32, RATE="fp64", BK="i32",
                                                  BV_FIXED="i32"),
                            dict(USE_RATE=True, PASS=3, HKV=hk, HG=hg, D=d, W=8, MIN_V=min_v, PACKET=pk, KS=ks_v,
                                 GATED=True),
                            num_warps=1, sass_dir=sd, tag=t)
            if not fixed and want(K._value_order):
                # depth-sorted (bit-product Values): slots by chunks (the default) and block-wide
                for sort, chunked in (((False, True), (True, True), (True, False)) if name == "flex"
                                      else ((False, True),)):
                    compile_one(K._value_order, dict(len_ptr=P32, vimp_ptr=PI, r_ptr=PI, hist_ptr=P32, tie_ptr=P32,
                                                     vdep_ptr="*i8", vord_ptr="*i16", vcnt_ptr=P32, TMAX="i32",
                                                     RATE="fp64", BK="i32", BV_FIXED="i32"),
                                dict(USE_RATE=True, HKV=hk, HG=hg, NT_PAD=K.next_pow2(hg * 32),
                                     SORT=sort, CHUNKED=chunked, **vc),
                                num_warps=nw, sass_dir=sd,
                                tag=t + ("-sort" if sort else "") + ("" if chunked or not sort else "-block"))
            if want(K._value_stage_f):
                for compact in ((False,) if fixed else (True, False)):
                    compile_one(K._value_stage_f, dict(vb_ptr="*u8", pt_ptr=P32, len_ptr=P32, logit_ptr=PI,
                                                       mstat_ptr=PI, sstat_ptr=PI, vimp_ptr=PI, r_ptr=PI, hist_ptr=P32,
                                                       tie_ptr=P32, tabf_ptr=PI, vdep_ptr="*i8", vord_ptr="*i16",
                                                       vcnt_ptr=P32, part_ptr=PI, SLOTS="i32", TMAX="i32", NSK="i32",
                                                       RATE="fp64", BK="i32", BV_FIXED="i32"),
                                dict(USE_RATE=True, HQ=hq, HKV=hk, HG=hg, G=g, G_PAD=gp, NSK_PAD=128, P=64, VG=1,
                                     NT_PAD=K.next_pow2(hg * 32), FIXED_V=fixed, COMPACT=compact,
                                     TS=32 * nw // (d // 8), **vc),
                                num_warps=nw, sass_dir=sd, tag=t + ("-compact" if compact else ""))
            if want(K._value_stage):
                compile_one(K._value_stage, dict(vb_ptr="*u8", pt_ptr=P32, len_ptr=P32, logit_ptr=PI, mstat_ptr=PI,
                                                 sstat_ptr=PI, vimp_ptr=PI, r_ptr=PI, hist_ptr=P32, tie_ptr=P32,
                                                 tab_ptr=P32, tabr_ptr=P32, vdep_ptr="*i8", part_ptr=PI,
                                                 SLOTS="i32", TMAX="i32", NSK="i32", RATE="fp64", BK="i32",
                                                 BV_FIXED="i32"),
                            dict(USE_RATE=True, HQ=hq, HKV=hk, HG=hg, G=g, G_PAD=gp, NSK_PAD=128, P=64, VG=1,
                                 NT_PAD=K.next_pow2(hg * 32), FIXED_V=fixed, T8=d >= 256,
                                 **vc),
                            num_warps=nw, sass_dir=sd, tag=t)
        if g <= 4 and want(L._lin_prep):  # the bit-product Key stage (linear codebooks)
            compile_one(L._lin_prep, dict(kdep_ptr=P32, wf_ptr=PI, base_ptr=PI, lina_ptr=PI, linw_ptr=PI, off_ptr=P32,
                                          vf_ptr="*fp16", nst_ptr=P32, base2_ptr=PI, SMAX="i32"),
                        dict(HQ=hq, HKV=hk, G=g, D=d, W=8, P=64), num_warps=4, sass_dir=sd, tag=tag)
        if g <= 4 and want(L._key_stage_mma):
            compile_one(L._key_stage_mma, dict(kb_ptr="*u8", pt_ptr=P32, len_ptr=P32, off_ptr=P32, vf_ptr=P32,
                                               nst_ptr=P32, base_ptr=PI, logit_ptr=PI, mstat_ptr=PI, sstat_ptr=PI,
                                               scale="fp32", SLOTS="i32", TMAX="i32", SMAX="i32"),
                        dict(HQ=hq, HKV=hk, G=g, D=d, W=8, P=64, NWARP=MMA_WARPS, PREFETCH=2, BITS=0),
                        num_warps=MMA_WARPS, sass_dir=sd, tag=tag)
        if g <= 4 and want(L._lin_prep_i8):  # the int8 bit-product Key stage (key_bits="int8")
            compile_one(L._lin_prep_i8, dict(kdep_ptr=P32, wf_ptr=PI, base_ptr=PI, lina_ptr=PI, linw_ptr=PI,
                                             off_ptr=P32, vd_ptr="*i8", nst_ptr=P32, base2_ptr=PI, vs_ptr=PI,
                                             SMAX="i32"),
                        dict(HQ=hq, HKV=hk, G=g, D=d, W=8, P=64), num_warps=4, sass_dir=sd, tag=tag)
        if g <= 4 and want(L._key_stage_imma):
            compile_one(L._key_stage_imma, dict(kb_ptr="*u8", pt_ptr=P32, len_ptr=P32, off_ptr=P32, vd_ptr=P32,
                                                nst_ptr=P32, base_ptr=PI, vs_ptr=PI, logit_ptr=PI, mstat_ptr=PI,
                                                sstat_ptr=PI, scale="fp32", SLOTS="i32", TMAX="i32", SMAX="i32"),
                        dict(HQ=hq, HKV=hk, G=g, D=d, W=8, P=64, NWARP=4, VST=True, PF=3), num_warps=4,
                        sass_dir=sd, tag=tag)
        if g <= 4 and want(L._value_stage_mma):
            compile_one(L._value_stage_mma, dict(vb_ptr="*u8", pt_ptr=P32, len_ptr=P32, logit_ptr=PI, mstat_ptr=PI,
                                                 sstat_ptr=PI, vord_ptr="*i16", vcnt_ptr=P32, lina_ptr=PI,
                                                 linw_ptr=PI, part_ptr=PI, vscale="fp32", SLOTS="i32", TMAX="i32",
                                                 NSK="i32"),
                        dict(HQ=hq, HKV=hk, G=g, G2=K.next_pow2(g), NSK_PAD=128, D=d, W=8, P=64, VG=1,
                             BLK=1024, BITS=2), num_warps=max(1, d // 128), sass_dir=sd, tag=tag)
        # as the reader launches each form (TritonReader._value_maxnreg): planes one or two at a time capped at
        # 128 registers, the pipelined forms 1 uncapped and 2 at 200
        forms = ((False, 0), (True, 0), (False, 1), (False, 2))
        for pair, vpf in forms if g <= 4 and want(L._value_stage_imma) else ():
            compile_one(L._value_stage_imma, dict(vb_ptr="*u8", pt_ptr=P32, len_ptr=P32, logit_ptr=PI, mstat_ptr=PI,
                                                  sstat_ptr=PI, vord_ptr="*i16", vcnt_ptr=P32, lina_ptr=PI,
                                                  linw_ptr=PI, part_ptr=PI, wmax="fp32", SLOTS="i32", TMAX="i32",
                                                  NSK="i32"),
                        dict(HQ=hq, HKV=hk, G=g, G2=K.next_pow2(g), NSK_PAD=128, D=d, W=8, P=64, VG=1,
                             BLK=1024, TS=256, PAIR=pair, VPF=vpf), num_warps=max(1, d // 128), sass_dir=sd,
                        tag=f"{tag}{'-pair' if pair else ''}{f'-vpf{vpf}' if vpf else ''}",
                        maxnreg=VALUE_MAXNREG[vpf])
        if want(K._combine):
            for inv in (False, True):  # the output rotated back by a GEMM after it, or in it (fuse_transforms)
                compile_one(K._combine, dict(part_ptr=PI, mu_ptr=PI, sig_ptr=PI, out_ptr=PI, NBLK="i32",
                                             mv_ptr=PI, fin_ptr=PI),
                            dict(HQ=hq, HKV=hk, G=g, G_PAD=gp, D=d, INV=inv), num_warps=8, sass_dir=sd,
                            tag=tag + ("-inv" if inv else ""))
        if want(E._encode_append):
            compile_one(E._encode_append, dict(k_ptr=PI, v_ptr=PI, kw_ptr=P32, vw_ptr=P32, pt_ptr=P32, start_ptr=P32,
                                               muk_ptr=PI, sigk_ptr=PI, muv_ptr=PI, sigv_ptr=PI, heap_ptr=PI,
                                               n_new="i32", SLOTS="i32"),
                        dict(HKV=hk, D=d, W=8, P=64, BT=32, VG=1), num_warps=8, sass_dir=sd, tag=tag)
        if want(F._fp8_stage1):
            compile_one(F._fp8_stage1, dict(q_ptr="*fp16", k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", ks_ptr=PI, vs_ptr=PI,
                                            len_ptr=P32, m_ptr=PI, s_ptr=PI, acc_ptr=PI, scale="fp32", TMAX="i32"),
                        dict(HQ=hq, HKV=hk, G=g, G_PAD=gp, D=d, NSPLIT=3, BT=64), sass_dir=sd, tag=tag)

    return list(RESULTS)


if __name__ == "__main__":
    main()
