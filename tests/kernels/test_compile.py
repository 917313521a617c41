"""Every Triton kernel the package launches compiles for the H200 (sm_90a) on this CPU-only machine.

Triton's interpreter (which the other kernel tests use) accepts programs that the compiler rejects (e.g. a
``tl.constexpr`` reassigned inside a ``static_range`` loop). This test runs the real pipeline on the launches of
decode steps that reach every kernel family and form: benchmarks/tools/sass_fingerprint.py traces each step's
launches as an H200 would bind them (signature, constexprs, divisibility attributes, options) and compiles each
with Triton's LLVM and the ptxas of Triton's wheel, in subprocesses without TRITON_INTERPRET.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# decode steps that together launch every kernel and form: the radix and two-pass allocations, Key refinement,
# the FMA, int8 and MMA stages (bit-serial and transposing Value tiles, compacting or not), the Full Reader,
# fused and unfused transforms, the encoder, the FP8 baseline and a tiered read (the FMA stages' tiered forms and
# the tiered Key refinement); each distinct compilation done once, in two processes (2 cores)
SCENARIOS = ("b1-flex-r2,b1-cons-r2,b32-flex-kr-r2,b32-cons-r2,b1-full4,d256-flex-r4,mqa16-cons-r2,encode-linear-v4,"
             "fp8,b32-flex-r4-linear-v4,d256-flex-r2-linear-v1,d256-w6-flex-r2-linear,b32-w6-flex-r2-linear,"
             "smol-flex-r2-linear-v1,mqa16-flex-r2,mqa16-d256-flex-r2,tiered-h4-flex-kr-r2")


def launched_kernels() -> set[str]:
    """The names of every ``kernel[grid](...)`` launch in planekv/kernels (the package's entry points)."""
    names = set()
    for path in (ROOT / "planekv" / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("_"):
                names.add(node.func.value.id)
    return names


@pytest.mark.slow
def test_every_launched_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found in a cache
    out = tmp_path / "fp.json"
    # the middle radix passes (3..7: only their digit's position differs) of two scenarios, the ungated and the
    # gated form; elsewhere passes 1, 2 and 8
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tools" / "sass_fingerprint.py"), "--out", str(out),
           "--only", SCENARIOS, "--jobs", "2", "--all-passes", "b1-flex-r2,b32-cons-r2,b32-flex-kr-r2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fp = json.loads(out.read_text())
    assert sorted(fp) == sorted(SCENARIOS.split(","))  # every scenario traced
    launches = [x for sc in fp.values() for x in sc["launches"] if x["sha"] is not None]  # the compiled ones
    compiled = {x["kernel"] for x in launches}
    assert launched_kernels() <= compiled, sorted(launched_kernels() - compiled)
    for x in launches:
        assert x["registers"] is not None and x["registers"] <= 255, x
