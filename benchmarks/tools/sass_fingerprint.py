"""Fingerprint every Triton launch of a decode step as an H200 would compile it, on a machine without a GPU.

    python benchmarks/tools/sass_fingerprint.py --out fp.json                 # record
    python benchmarks/tools/sass_fingerprint.py --out new.json --compare fp.json

For a matrix of step configurations (geometry, policy, codebook, V run layout, batch, tokens, CUDA or CPU
decisions, batch parts) the reader plans and runs a step with every kernel launch intercepted: Triton's own
binder computes what the launch would compile for sm_90a (signature, constexprs, the divisibility attributes of
its arguments, launch options), the kernel is compiled with the ptxas of Triton's wheel, and its SASS is hashed
(the function's name left out). Nothing runs: ``run()`` is a fixed launch sequence that reads no device data.

Two fingerprints agree where a change left every step's launches the same: the same kernels in the same order,
compiled to the same SASS, with the same grids, options and scalar arguments. That is what "the kernels stay as
fast as they are" means for a refactor, checked without a GPU (docs/KERNELS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit as tjit

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CUDA = types.SimpleNamespace(type="cuda")  # what the reader's device predicates are shown in "cuda" scenarios
_SIM = {"cuda": False}  # the scenario being traced decides as on an H200


# ----------------------------------------------------------------------------- scenarios

@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    hq: int
    hk: int
    d: int
    batch: int
    tokens: int
    policy: str  # a key of POLICIES
    codebook: str = "gaussian-lloyd-tree"
    v_run: int = 1
    device: str = "cuda"  # "cuda": the reader decides as on an H200; "cpu": as in Triton's interpreter
    batch_streams: int = 1
    page_size: int = 64
    width: int = 8  # planes stored (W)
    tiered_hot: int | None = None  # a read of a TieredCache with this many hot planes (FMA stages) instead


def _policies():
    from planekv.kvstore import ReadPolicy

    return {
        "flex-r2": ReadPolicy.flexible(2.0),
        "flex-r4": ReadPolicy.flexible(4.0),
        "flex-kr-r2": ReadPolicy.flexible(2.0, key_refine=0.3),
        "cons-r2": ReadPolicy.constrained(2.0),
        "cons-r4": ReadPolicy.constrained(4.0),
        "budgets": ReadPolicy(rate=None, budget_k=150, budget_v=300, pool_heads=False),
        "head-weight": ReadPolicy.flexible(2.0, value_head_weight=True),
        "full4": None,  # the Full Reader baseline: fixed depth 4
        "encode": None,  # the encode/append kernel (Encoder), not a read
        "fp8": None,  # the FP8 baseline's two kernels (FP8Decode)
    }


def scenarios() -> list[Scenario]:
    """The default paths of every benchmark geometry and policy, the named options, and the MQA path."""
    out: list[Scenario] = []
    big = dict(hq=32, hk=8, d=128, batch=32, tokens=32768)
    b1 = dict(hq=32, hk=8, d=128, batch=1, tokens=8192)
    smol = dict(hq=9, hk=3, d=64, batch=32, tokens=8192)
    d256 = dict(hq=4, hk=1, d=256, batch=32, tokens=32768)
    for gname, geo in (("b32", big), ("b1", b1), ("smol", smol), ("d256", d256)):
        for pol in ("flex-r2", "flex-r4", "flex-kr-r2", "cons-r2", "full4"):
            out.append(Scenario(f"{gname}-{pol}", **geo, policy=pol))
        for pol in ("flex-r2", "flex-r4", "cons-r2"):
            for vr in (1, 4):
                out.append(Scenario(f"{gname}-{pol}-linear-v{vr}", **geo, policy=pol, codebook="uniform-linear-c3",
                                    v_run=vr))
    out += [
        Scenario("b32-budgets", **big, policy="budgets"),
        Scenario("b32-head-weight", **big, policy="head-weight"),
        Scenario("b32-flex-r2-streams2", **big, policy="flex-r2", batch_streams=2),
        Scenario("b32-flex-r2-linear-v4-streams2", **big, policy="flex-r2", codebook="uniform-linear-c3", v_run=4,
                 batch_streams=2),
        Scenario("b32-flex-r2-v4", **big, policy="flex-r2", v_run=4),
        Scenario("b1-flex-r2-linear-v4-cpu", **b1, policy="flex-r2", codebook="uniform-linear-c3", v_run=4,
                 device="cpu"),
        Scenario("smol-flex-r2-linear-cpu", **smol, policy="flex-r2", codebook="uniform-linear-c3", device="cpu"),
        Scenario("b32-t1000-flex-r2-linear", hq=32, hk=8, d=128, batch=32, tokens=1000, policy="flex-r2",
                 codebook="uniform-linear-c3"),
        # more than 8 query heads per KV head: the MMA-assembly stages (FMA stages hold <= 8 accumulators)
        Scenario("mqa16-flex-r2", hq=32, hk=2, d=128, batch=8, tokens=8192, policy="flex-r2"),
        Scenario("mqa16-cons-r2", hq=32, hk=2, d=128, batch=8, tokens=8192, policy="cons-r2"),
        Scenario("mqa16-d256-flex-r2", hq=16, hk=1, d=256, batch=8, tokens=8192, policy="flex-r2"),
        Scenario("mqa16-p128-flex-r4", hq=32, hk=2, d=128, batch=4, tokens=8192, policy="flex-r4", page_size=128),
        Scenario("mqa16-full4", hq=32, hk=2, d=128, batch=8, tokens=8192, policy="full4"),
        # a width that is not a multiple of 4: the int8 Value stage's unpipelined forms, planes two at a time at d=256
        Scenario("d256-w6-flex-r2-linear", **d256, policy="flex-r2", codebook="uniform-linear-c3", width=6),
        Scenario("b32-w6-flex-r2-linear", **big, policy="flex-r2", codebook="uniform-linear-c3", width=6),
        Scenario("encode", hq=32, hk=8, d=128, batch=2, tokens=100, policy="encode"),
        Scenario("encode-linear-v4", hq=32, hk=8, d=128, batch=2, tokens=100, policy="encode",
                 codebook="uniform-linear-c3", v_run=4),
        Scenario("fp8", hq=32, hk=8, d=128, batch=4, tokens=4096, policy="fp8"),
        # a read of a tiered cache (docs/TIERING.md): the FMA stages' tiered forms and the tiered Key refinement
        Scenario("tiered-h4-flex-kr-r2", hq=32, hk=8, d=128, batch=2, tokens=300, policy="flex-kr-r2", tiered_hot=4),
    ]
    return out


# ----------------------------------------------------------------------------- interception

LAUNCHES: list[dict[str, Any]] = []
BUFFERS: dict[str, torch.Tensor] = {}  # the step's named tensors: a pointer argument is recorded as one of them


def _buffer_name(t: torch.Tensor) -> str:
    """Which named tensor (plan buffer, reader constant, step input) a pointer argument points into, and where."""
    ptr = t.data_ptr()
    for name, base in BUFFERS.items():
        lo = base.data_ptr()
        if lo <= ptr < lo + max(1, base.numel() * base.element_size()):
            return name if ptr == lo else f"{name}+{ptr - lo}"
    return f"unnamed{tuple(t.shape)}"
_BACKEND = make_backend(TARGET)
_BINDERS: dict[int, Any] = {}


def _record(self, *args, grid, warmup, **kwargs):  # replaces JITFunction.run: bind as the GPU would, launch nothing
    kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = _BINDERS.get(id(self))
    if binder is None:
        binder = _BINDERS[id(self)] = tjit.create_function_from_signature(self.signature, self.params, _BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(_BACKEND, kwargs, bound_args, specialization, options)
    if callable(grid):
        grid = grid(bound_args)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    names = [p.name for p in self.params]
    scalars, pointers = {}, {}
    for name, val, spec in zip(names, bound_args.values(), specialization, strict=True):
        if spec[0] == "constexpr" or val is None:
            continue
        if isinstance(val, torch.Tensor):
            pointers[name] = _buffer_name(val)
        else:
            scalars[name] = val if isinstance(val, (int, float, bool)) else repr(val)
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg", "num_ctas") if k in kwargs}
    named = {self.params[path[0]].name: v for path, v in constexprs.items() if len(path) == 1}
    LAUNCHES.append(dict(fn=self, kernel=self.fn.__name__, grid=grid, options=opts, scalars=scalars,
                         pointers=pointers, signature=signature, constexprs=constexprs, attrs=attrs, named=named))
    return None


def _patch_reader() -> None:
    """CPU tensors pass the device check; "cuda" scenarios see a 132-SM CUDA device in the reader's predicates."""
    tjit.JITFunction.run = _record
    torch.cuda.get_device_properties = lambda dev=None: types.SimpleNamespace(multi_processor_count=132)
    import planekv.kernels.reader as R
    from planekv.kernels import _dispatch

    _dispatch.check_device = lambda *ts: ts[0].device
    R.check_device = _dispatch.check_device
    import planekv.kernels.encode as E
    import planekv.kernels.fp8 as F

    E.check_device = F.check_device = _dispatch.check_device
    try:  # the zero-copy promotion kernel (trees since it was added)
        import planekv.kernels.host_gather as HG

        HG.check_device = _dispatch.check_device
    except ImportError:
        pass
    if hasattr(R, "target_of"):  # the reader decides by planekv.kernels.config.Target
        from planekv.kernels.config import Target

        orig_target = R.target_of
        R.target_of = lambda dev: Target(True, 132) if _SIM["cuda"] else orig_target(dev)
        return
    for name in ("_key_mma", "_value_mma"):
        orig = getattr(R.TritonReader, name)

        def wrap(self, dev, small=False, _orig=orig):
            return _orig(self, CUDA if getattr(self, "_fp_cuda", False) else dev, small)
        setattr(R.TritonReader, name, wrap)
    orig_n = R.TritonReader._imma_maxnreg
    R.TritonReader._imma_maxnreg = lambda self, n, dev: _imma_cap(self, orig_n, n, dev)


def _imma_cap(self, orig, n, dev):
    return orig(self, n, CUDA if getattr(self, "_fp_cuda", False) else dev)


def trace(sc: Scenario) -> list[dict[str, Any]]:
    """The launches of one step of ``sc``, in order."""
    from planekv.kernels import TritonReader
    from planekv.kvstore import Codec, FormatSpec
    from planekv.kvstore.calibration import calibrate
    from planekv.kvstore.planes import v_page_shape

    g = torch.Generator().manual_seed(0)
    spec0 = FormatSpec(model_id="fp", n_layers=1, n_q_heads=sc.hq, n_kv_heads=sc.hk, head_dim=sc.d,
                       calibration_id="-", codebook=sc.codebook, v_run=sc.v_run, page_size=sc.page_size,
                       width=sc.width)
    cal = calibrate(torch.randn(1, sc.hk, 256, sc.d, generator=g), torch.randn(1, sc.hk, 256, sc.d, generator=g),
                    spec0.seed_k, spec0.seed_v)
    spec = dataclasses.replace(spec0, calibration_id=cal.calibration_id)
    codec = Codec(spec, cal)
    if sc.policy in ("encode", "fp8"):
        return _trace_other(sc, codec)
    pol = _policies()[sc.policy]
    if sc.tiered_hot is not None:
        return _trace_tiered(sc, codec, pol)
    if pol is not None and pol.width != sc.width:
        pol = dataclasses.replace(pol, width=sc.width)
    try:
        from planekv.kernels import ReaderConfig
        kw: dict[str, Any] = {"config": ReaderConfig(batch_streams=sc.batch_streams)}
    except ImportError:  # the layout before ReaderConfig: attributes
        kw = {}
    reader = TritonReader(codec, pol, **kw) if pol is not None else TritonReader(codec, fixed_depth=4, **kw)
    reader._fp_cuda = _SIM["cuda"] = sc.device == "cuda"
    if not kw:
        reader.batch_streams = sc.batch_streams
    plan = reader.plan(sc.batch, sc.tokens, "cpu")
    w, p = spec.width, spec.page_size
    k_pool = torch.zeros(2, w, sc.d, p // 8, dtype=torch.uint8)
    v_pool = torch.zeros(2, *v_page_shape(spec), dtype=torch.uint8)
    slots = math.ceil(sc.tokens / p)
    pt = torch.zeros(sc.batch, sc.hk, slots, dtype=torch.int32)
    lengths = torch.full((sc.batch,), sc.tokens, dtype=torch.int32)
    q = torch.zeros(sc.batch, sc.hq, sc.d, dtype=torch.float16)
    BUFFERS.clear()
    BUFFERS.update(q=q, k_pool=k_pool, v_pool=v_pool, page_table=pt, lengths=lengths)
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, torch.Tensor) and v.numel() > 1:  # one-element placeholders are shared, not named
            BUFFERS[f"plan.{f.name}"] = v
    consts = getattr(reader, "_consts", {}).get(torch.device("cpu"), {})
    if not consts and hasattr(reader, "constants"):
        consts = reader.constants(torch.device("cpu"))
    for k, v in consts.items():
        BUFFERS[f"const.{k}"] = v
    del LAUNCHES[:]
    reader.run(plan, q, k_pool, v_pool, pt, lengths, 0)
    return list(LAUNCHES)


def _trace_tiered(sc: Scenario, codec, pol) -> list[dict[str, Any]]:
    """The launches of one step of ``sc`` over a TieredCache of ``sc.tokens`` tokens per sequence (sealed pages,
    an open one, Key page slots), read by the FMA stages as decode_tiered reads it, after a zero-copy promotion of
    Key channel-planes (``planekv.kernels.host_gather``)."""
    from planekv.kernels import ReaderConfig, TritonReader
    from planekv.tiering import PlacementPolicy, TieredCache
    from planekv.tiering.placement import HotPlanes

    spec, h = codec.spec, sc.tiered_hot
    cache = TieredCache(spec, sc.batch, PlacementPolicy(hot_planes=HotPlanes(k=h, v=h), width=spec.width),
                        max_tokens=sc.tokens, promotion_bytes=8 << 20, key_page_bytes=8 << 20)
    codes = torch.zeros(sc.batch, sc.hk, sc.tokens, sc.d, dtype=torch.uint8)
    cache.append(0, codes, codes.clone())
    reader = TritonReader(codec, pol, config=ReaderConfig(assembly="fma", key_int8=False, value_int8=False))
    reader._fp_cuda = _SIM["cuda"] = sc.device == "cuda"
    q = torch.zeros(sc.batch, sc.hq, sc.d, dtype=torch.float16)
    BUFFERS.clear()
    BUFFERS.update(q=q)
    del LAUNCHES[:]
    if hasattr(cache, "zero_copy"):  # a zero-copy promotion of two Key channel-planes (CUDA's default), traced
        cache.zero_copy = True
        cache.promote_keys(0, [(0, 0, 0, h), (sc.batch - 1, sc.hk - 1, sc.d - 1, spec.width - 1)])
    reader.decode_tiered(q, cache, 0)
    return list(LAUNCHES)


def _trace_other(sc: Scenario, codec) -> list[dict[str, Any]]:
    """The launches of an append of 100 tokens (``encode``) or of one FP8 decode step (``fp8``)."""
    from planekv.kernels.encode import Encoder
    from planekv.kernels.fp8 import FP8Decode
    from planekv.kvstore.planes import v_page_shape

    spec = codec.spec
    BUFFERS.clear()
    del LAUNCHES[:]
    if sc.policy == "encode":
        pages = math.ceil(sc.tokens / spec.page_size)
        k = torch.zeros(sc.batch, sc.hk, sc.tokens, sc.d, dtype=torch.float16)
        k_pool = torch.zeros(sc.batch * sc.hk * pages, spec.width, sc.d, spec.page_size // 8, dtype=torch.uint8)
        v_pool = torch.zeros(sc.batch * sc.hk * pages, *v_page_shape(spec), dtype=torch.uint8)
        pt = torch.zeros(sc.batch, sc.hk, pages, dtype=torch.int32)
        starts = torch.zeros(sc.batch, dtype=torch.int32)
        BUFFERS.update(k_pool=k_pool, v_pool=v_pool, page_table=pt, starts=starts)
        Encoder(codec).launch(k, k.clone(), k_pool, v_pool, pt, starts, 0)
    else:
        f = FP8Decode(sc.hq, sc.hk, sc.d)
        plan = f.plan(sc.batch, sc.tokens, "cpu")
        q = torch.zeros(sc.batch, sc.hq, sc.d, dtype=torch.float16)
        k8 = torch.zeros(sc.batch, sc.hk, sc.tokens, sc.d, dtype=torch.float8_e4m3fn)
        scales = torch.ones(sc.hk)
        lengths = torch.full((sc.batch,), sc.tokens, dtype=torch.int32)
        BUFFERS.update(q=q, k8=k8, lengths=lengths, **{f"plan.{k}": v for k, v in plan.items()
                                                       if isinstance(v, torch.Tensor)})
        f.run(plan, q, k8, k8.clone(), scales, scales.clone(), lengths)
    return list(LAUNCHES)


# ----------------------------------------------------------------------------- compile

_SASS: dict[str, dict[str, Any]] = {}


def _key(rec: dict[str, Any]) -> str:
    return repr((rec["fn"].fn.__module__, rec["kernel"], sorted(rec["signature"].items()),
                 sorted((repr(k), repr(v)) for k, v in rec["constexprs"].items()),
                 sorted((repr(k), repr(v)) for k, v in rec["attrs"].items()), sorted(rec["options"].items())))


def sass_of(rec: dict[str, Any]) -> dict[str, Any]:
    """The launch's kernel compiled for sm_90a: sha256 of its SASS without the function's name, registers."""
    key = _key(rec)
    if key in _SASS:
        return _SASS[key]
    src = ASTSource(fn=rec["fn"], signature=rec["signature"], constexprs=rec["constexprs"], attrs=rec["attrs"])
    k = triton.compile(src, target=TARGET, options=dict(rec["options"]))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    body = [ln for ln in sass.splitlines() if "Function :" not in ln and ln.strip()
            and not ln.lstrip().startswith(("code for", "Fatbin", "=====", ".headerflags", "arch =", "code version",
                                            "host =", "compile_size", "-----"))]
    body = [re.sub(re.escape(rec["kernel"]), "KERNEL", ln) for ln in body]
    regs = re.search(r"REG:(\d+)", res)
    # the same code with its parameters elsewhere in the constant bank (a dead runtime parameter removed)
    norm = [re.sub(r"/\* 0x[0-9a-f]+ \*/", "", re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", ln)) for ln in body]
    out = {"sha": hashlib.sha256("\n".join(body).encode()).hexdigest()[:16],
           "sha_params": hashlib.sha256("\n".join(norm).encode()).hexdigest()[:16],
           "registers": int(regs.group(1)) if regs else None, "shared": k.metadata.shared}
    _SASS[key] = out
    return out


_PENDING: list[dict[str, Any]] = []  # one launch per distinct compilation (the forked workers read it)


def _compile_pending(i: int) -> dict[str, Any]:
    return sass_of(_PENDING[i])


def _middle_pass(rec: dict[str, Any]) -> bool:
    """A radix pass other than the first, second and last (the middle ones differ only in their digit's position)."""
    pas = rec["named"].get("PASS")
    return pas is not None and pas not in (1, 2, 8)


def fingerprint(scs: list[Scenario], jobs: int = 1, all_passes: set[str] | None = None, log=print) -> dict[str, Any]:
    """Every scenario traced first; each distinct compilation then done once, in ``jobs`` forked processes.
    ``all_passes``: compile the middle radix passes of these scenarios only (the others' are listed, not compiled)."""
    t0 = time.time()
    traced = [(sc, trace(sc)) for sc in scs]
    _PENDING.clear()
    seen: set[str] = set()
    skipped: set[str] = set()
    for sc, recs in traced:
        for r in recs:
            if all_passes is not None and sc.name not in all_passes and _middle_pass(r):
                skipped.add(_key(r))
                continue
            if _key(r) not in seen:
                seen.add(_key(r))
                _PENDING.append(r)
    log(f"{len(scs)} scenarios traced: {sum(len(r) for _, r in traced)} launches, {len(_PENDING)} distinct "
        f"compilations, {time.time() - t0:.0f} s")
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for r, out in zip(_PENDING, pool.imap(_compile_pending, range(len(_PENDING))), strict=True):
                _SASS[_key(r)] = out
    else:
        for i, r in enumerate(_PENDING):
            sass_of(r)
            if (i + 1) % 25 == 0:
                log(f"  {i + 1}/{len(_PENDING)} compiled, {time.time() - t0:.0f} s")
    log(f"compiled in {time.time() - t0:.0f} s")
    result: dict[str, Any] = {}
    not_compiled = {"sha": None, "sha_params": None, "registers": None, "shared": None}
    for sc, recs in traced:
        rows = [dict(kernel=r["kernel"], grid=list(r["grid"]), options=r["options"], scalars=r["scalars"],
                     pointers=r["pointers"], **_SASS.get(_key(r), not_compiled)) for r in recs]
        result[sc.name] = {"scenario": dataclasses.asdict(sc), "launches": rows}
    return result


def compare(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """Differences between two fingerprints, one line each (kernel names alone may differ: reported as renames)."""
    diffs: list[str] = []
    renames: set[tuple[str, str]] = set()
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            diffs.append(f"{name}: only in {'new' if name in new else 'old'}")
            continue
        a, b = old[name]["launches"], new[name]["launches"]
        if len(a) != len(b):
            diffs.append(f"{name}: {len(a)} launches -> {len(b)}: "
                         f"{[x['kernel'] for x in a]} -> {[x['kernel'] for x in b]}")
            continue
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            where = f"{name} launch {i} ({x['kernel']} -> {y['kernel']})"
            if x["sha"] != y["sha"]:
                same_code = x.get("sha_params") == y.get("sha_params")
                diffs.append(f"{where}: SASS differs{' only in parameter offsets' if same_code else ''}")
            for f in ("grid", "options", "scalars"):
                if x[f] != y[f]:
                    diffs.append(f"{where}: {f} {x[f]} -> {y[f]}")
            xp, yp = x.get("pointers", {}), y.get("pointers", {})
            for p in sorted(set(xp) & set(yp)):  # a parameter kept under its name must get the same buffer
                if xp[p] != yp[p]:
                    diffs.append(f"{where}: pointer {p} {xp[p]} -> {yp[p]}")
            if set(xp) != set(yp):
                diffs.append(f"{where}: pointer parameters {sorted(set(xp) ^ set(yp))} only on one side")
            if x["kernel"] != y["kernel"]:
                renames.add((x["kernel"], y["kernel"]))
    diffs += [f"renamed (same SASS): {a} -> {b}" for a, b in sorted(renames)]
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="write the fingerprint (JSON) here")
    ap.add_argument("--compare", help="a fingerprint to compare with; exit 1 where a launch differs")
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    ap.add_argument("--all-passes", default=None,
                    help="compile the middle radix passes (3..7) of these scenarios only (comma-separated)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
    _patch_reader()
    scs = scenarios()
    if args.only:
        want = set(args.only.split(","))
        scs = [s for s in scs if s.name in want]
    unknown = set(args.only.split(",")) - {s.name for s in scenarios()} if args.only else set()
    if unknown:
        sys.exit(f"unknown scenarios: {sorted(unknown)}")
    all_passes = set(args.all_passes.split(",")) if args.all_passes is not None else None
    fp = fingerprint(scs, jobs=args.jobs, all_passes=all_passes)
    with open(args.out, "w") as f:
        json.dump(fp, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        if args.only:
            old = {k: v for k, v in old.items() if k in fp}
        diffs = compare(fp, old)
        real = [d for d in diffs if not d.startswith("renamed")]
        print("\n".join(diffs) or "identical")
        return 1 if real else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
