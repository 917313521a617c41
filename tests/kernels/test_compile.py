"""Every Triton kernel compiles for the H200 (sm_90a) on this CPU-only machine.

Triton's interpreter (which the other kernel tests use) accepts programs that the compiler rejects,
e.g. a ``tl.constexpr`` reassigned inside a ``static_range`` loop; run 14 lost a GPU call to that.
This test runs the real pipeline (TTIR -> PTX with Triton's LLVM, then the ptxas of Triton's wheel)
for the reader's geometry, every radix pass included, in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_prep", "_key_stage", "_key_stage_t8", "_key_stage_f", "_value_order", "_value_stage_f", "_radix_select",
           "_value_hist", "_value_radix", "_value_ties", "_value_stage", "_value_stage_c", "_combine", "_encode_append",
           "_fp8_stage1", "_refine_score", "_refine_select", "_refine_radix", "_refine_ties", "_refine_order",
           "_key_refine_f", "_key_restat", "_v_bracket", "_v_cand", "_v_exact", "_v_exact_split", "_value_sample",
           "_lin_prep", "_key_stage_mma",
           "_value_stage_mma", "_lin_prep_i8", "_key_stage_imma", "_value_stage_imma"}


STAGES = {"_value_stage_imma", "_key_stage_imma", "_value_stage_mma", "_key_stage_mma", "_lin_prep", "_lin_prep_i8",
          "_key_stage_f", "_value_stage_f", "_key_stage", "_key_stage_t8", "_value_stage", "_value_stage_c"}


def test_all_kernels_compile_for_sm90(tmp_path):
    from planekv.kernels.decode import NPASS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    # two processes at once (the Key / Value stages, and every other kernel: ~80 s and ~115 s of
    # compiling on this 2-core machine, instead of ~195 s in one)
    procs = []
    for part, arg in (("stages", "--only"), ("rest", "--skip")):
        out = tmp_path / f"recs-{part}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "tools" / "compile_check.py"), "--geometries", "32/8/128",
               "--num-warps", "4", "--all-radix-passes", arg, ",".join(sorted(STAGES)), "--json", str(out)]
        procs.append((out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True)))
    recs = []
    for out, proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        recs += json.loads(out.read_text())
    assert KERNELS <= {r["kernel"].split("[")[0] for r in recs}
    # 3 variants x (prep by depth segments, prep in channel order, prep with radix passes, value stage)
    # + 2 x 5 key stages (MMA serial, MMA transposing, FMA by segments, FMA in channel order, FMA by
    #   segments 4 channels at a time)
    # + 2 compacting value stages
    # + FMA value stages (2 x 2 + 1) + 2 value orders + 2 radix selects
    # + 2 x (hist, NPASS-1 radix passes ungated and gated, ties) + 3 others (combine, encode, FP8)
    #   + the combine with the output transform
    # + Key refinement, 2 x (score, 2 selects, NPASS-1 radix passes, ties, order, decode, stats)
    # + two-pass Value allocation, 2 x (importance histogram, gated radix pass 1, bracket, candidates, exact)
    #   and its sampled bracket, 2 x (the sample's histogram, bracket, candidates with the importances,
    #   the binned exact pass in one program and split over several)
    # + the bit-product Key stage (linear codebooks): its operand kernel and the stage, fp16 and int8
    # + the bit-product Value stage and the depth-sorted value order (flexible) it reads
    # + the int8 Value stage, planes one and two at a time, and its two software-pipelined forms
    # + the depth-sorted order's block-wide slots, the gated tie counts (both readers)
    n_radix = NPASS.value - 1
    assert len(recs) == (3 * 4 + 10 + 2 + 5 + 2 + 2 + 2 * (1 + 2 * n_radix + 1) + 3 + 1 + 2 * (7 + n_radix) + 2 * 5 + 2
                         + 2 + 2 + 2 + 1 + 2 + 2 + 2 * 5)
    for r in recs:
        assert r["registers"] is not None and r["registers"] <= 255, r["line"]
