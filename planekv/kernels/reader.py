"""TritonReader: the two-stage ReadKV decode read on the GPU (or Triton's interpreter on CPU tensors).

``plan(batch, max_tokens)`` sizes every buffer once for a step shape and resolves the :class:`ReaderConfig`
into that shape's :class:`StepChoices`; ``run(...)`` is a fixed launch sequence, one launcher per stage, that
allocates nothing, reads lengths and page tables from device tensors and can be captured in a CUDA graph
(decode appends only change device data). docs/KERNELS.md lists the stages, their kernels and files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from ..kvstore import Codec, PlaneKVCache, ReadPolicy, ReadStats, UniformLinearTree
from ..kvstore.accounting import two_stage_workspace_bytes
from ..kvstore.allocate import step_gains
from ..kvstore.format import FormatSpec
from ..kvstore.planes import v_page_shape
from ..kvstore.tiered_pools import TieredPools
from . import (
    combine,
    key_stage_fma,
    key_stage_int8,
    key_stage_mma,
    prep,
    refine,
    value_alloc,
    value_alloc_two_pass,
    value_stage_fma,
    value_stage_int8,
    value_stage_mma,
)
from ._dispatch import check_device
from .common import next_pow2
from .config import ReaderConfig, ReadShape, StepChoices, resolve, resolve_assembly, resolve_compact, target_of
from .plan import Plan, ReadConsts, Step
from .prep import KSEG_WORDS
from .radix import HIST_STRIDE
from .refine import HIST_STRIDE_R, RSEL_STRIDE
from .tables import linear_tables, packed_table, reversed_table, reversed_table_f32
from .value_alloc import CMETA_WORDS
from .value_alloc_two_pass import EXACT_BINS, IH_BINS

# stage -> launcher of the kernel family that runs it (StepChoices.key_stage / value_stage)
KEY_STAGES: dict[str, Callable[..., None]] = {"fma": key_stage_fma.launch, "int8": key_stage_int8.launch,
                                              "transpose": key_stage_mma.launch}
VALUE_STAGES: dict[str, Callable[..., None]] = {"fma": value_stage_fma.launch, "int8": value_stage_int8.launch,
                                                "compact": value_stage_mma.launch, "tile": value_stage_mma.launch}


class TieredSource(Protocol):
    """A tiered cache as :meth:`TritonReader.decode_tiered` reads it (``planekv.tiering.TieredCache``)."""

    lengths: torch.Tensor  # [L, B]
    page_table: torch.Tensor  # [B, Hkv, slots]

    def check_format(self, format_id: str) -> None: ...

    def pools(self, layer: int) -> TieredPools: ...


def check_v_pool(v_pool: torch.Tensor, spec: FormatSpec) -> None:
    """Refuse a V pool whose page shape is not the format's: [pages, W, P, d/8], or [pages, W/g, P, g, d/8]
    with ``spec.v_run`` = g > 1."""
    want = v_page_shape(spec)
    if tuple(v_pool.shape[1:]) != want:
        raise ValueError(f"v_pool must be [pages, {', '.join(map(str, want))}] for this format (v_run = {spec.v_run}), "
                         f"got {tuple(v_pool.shape)}")


class TritonReader:
    """Two-stage ReadKV decode on the GPU (or Triton's interpreter on CPU tensors).

    Both readers: the flexible one (pooled budgets, depth 0, tuned split; the default) and the constrained one
    (per-head budgets, minimum depth 1, Value packets); either with the third stage, Key refinement
    (``ReadPolicy.key_refine`` at token granularity, FMA stages only). ``fixed_depth`` > 0 makes it the Full
    Reader baseline (every channel and token at that depth, no allocation). ``config`` chooses how the step
    runs, never what it computes.
    """

    def __init__(self, codec: Codec, policy: ReadPolicy | None = None, config: ReaderConfig | None = None,
                 fixed_depth: int = 0) -> None:
        self.codec = codec
        self.config = config if config is not None else ReaderConfig()
        self.fixed_depth = fixed_depth
        if fixed_depth:
            # Full Reader: every K channel and V token at one depth, read fully; no allocation.
            policy = ReadPolicy(width=codec.width, rate=float(fixed_depth), min_depth_k=fixed_depth,
                                min_depth_v=fixed_depth, pool_heads=False, reader="constrained")
        self.policy = pol = policy or ReadPolicy.flexible(4.0)
        spec = codec.spec
        if pol.width != spec.width:
            raise ValueError(f"policy width {pol.width} != stored width {spec.width}")
        if spec.head_dim % 32 or spec.head_dim & (spec.head_dim - 1):
            raise ValueError(f"Triton reader needs a power-of-two head dim >= 32, got {spec.head_dim}")
        if spec.page_size % 32:
            raise ValueError("page size must be a multiple of 32")
        ref_only = pol.reference_only_options()
        if ref_only:
            raise ValueError(f"the Triton reader does not implement {ref_only} (reference reader only)")
        d, w = spec.head_dim, spec.width
        hg = spec.n_kv_heads if pol.pool_heads else 1
        bk = pol.key_budget(d)
        refine_on = pol.key_refine > 0
        # the channel stage's share of B_K (all of it without refinement), as the reference computes it
        bk_stage = max(math.floor(bk * (1.0 - pol.key_refine)), pol.min_depth_k * d) if refine_on else bk
        if bk < pol.min_depth_k * d:
            raise ValueError(f"Key budget {bk} below the minimum depth {pol.min_depth_k} x {d}")
        count_k = max(0, min(bk_stage * hg - pol.min_depth_k * hg * d, (w - pol.min_depth_k) * hg * d))
        dist = codec.tree.distortion
        rk = step_gains(dist, w, pol.min_depth_k, 1)
        rv = step_gains(dist, w, pol.min_depth_v, pol.v_packet)
        kspad_k, kspad_v = next_pow2(max(1, len(rk))), next_pow2(max(1, len(rv)))
        linear = isinstance(codec.tree, UniformLinearTree)
        self.consts = ReadConsts(
            hq=spec.n_q_heads, hk=spec.n_kv_heads, g=spec.group_size, d=d, w=w, p=spec.page_size, vg=spec.v_run,
            hg=hg, ks_k=len(rk), kspad_k=kspad_k, ks_v=len(rv), kspad_v=kspad_v, min_k=pol.min_depth_k,
            min_v=pol.min_depth_v, packet=pol.v_packet, use_rate=pol.rate is not None,
            rate=float(pol.rate) if pol.rate is not None else 0.0,
            bv_fixed=0 if pol.rate is not None else int(pol.budget_v),  # type: ignore[arg-type]
            bk=bk, bk_stage=bk_stage, count_k=count_k, head_weight=pol.value_head_weight, refine=refine_on,
            rhw=next_pow2(hg) * HIST_STRIDE_R, fixed_depth=fixed_depth,
            wmax=ReadConsts.wmax_of(codec.tree) if linear else 1.0)
        mean_v = (2 * d * pol.rate - bk) / d if pol.rate is not None else float(w)
        self.shape = ReadShape(
            n_q_heads=spec.n_q_heads, n_kv_heads=spec.n_kv_heads, head_dim=d, width=w, page_size=spec.page_size,
            linear=linear, fixed_depth=fixed_depth, min_depth_v=pol.min_depth_v, mean_value_depth=mean_v,
            budget_heads=hg, value_steps=len(rv), key_keys=kspad_k)
        self.assembly = resolve_assembly(self.config, self.shape)  # checked here: refused before any plan
        self.compact_values = resolve_compact(self.config, self.shape, self.assembly)
        if refine_on and self.assembly != "fma":
            raise ValueError("Key refinement runs on the FMA stages only (assembly='fma', <= 8 query heads "
                             f"per KV head), got assembly={self.assembly!r}")
        rk_t = torch.zeros(kspad_k, dtype=torch.float32)
        rk_t[: len(rk)] = torch.tensor(rk, dtype=torch.float32)
        rv_t = torch.zeros(kspad_v, dtype=torch.float32)
        rv_t[: len(rv)] = torch.tensor(rv, dtype=torch.float32)
        c = codec.calibration
        self._consts_cpu = {
            "mu_k": c.mu_k, "sig_k": c.sigma_k, "mu_v": c.mu_v, "sig_v": c.sigma_v,
            "mkT": codec.rot_k.matrix.T.float().contiguous(), "mv": codec.rot_v.matrix.float().contiguous(),
            "tab2": packed_table(codec), "tabr": reversed_table(codec), "tabf": reversed_table_f32(codec),
            "tabw": codec.tree.table().float()[codec.width].contiguous(),  # depth W, stored code order
            "tabk": codec.tree.table().float().contiguous(),  # [W + 1, 2^W]: every depth (tiered refinement)
            "dist": torch.tensor(codec.tree.distortion, dtype=torch.float32),
            "rk": rk_t, "rv": rv_t,
            "hw": (c.sigma_v * c.sigma_v).sum(-1).contiguous(),  # [L, Hkv] for value_head_weight
        }
        if linear:  # a linear codebook's a_t and w_tj (the int8 stages)
            a, wt = linear_tables(codec.tree)
            self._consts_cpu.update(lin_a=a, lin_w=wt.reshape(-1).contiguous())
        self._consts: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._plan_cache: dict[tuple[int, torch.device], Plan] = {}

    @property
    def refine(self) -> bool:
        return self.consts.refine

    def constants(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The constant tables on ``device`` (copied there once)."""
        if device not in self._consts:
            self._consts[device] = {k: v.to(device).contiguous() for k, v in self._consts_cpu.items()}
        return self._consts[device]

    # ---- plan ----

    def choices(self, batch: int, max_tokens: int, device: torch.device | str,
                pages_per_program: int | None = None, block_tokens: int | None = None) -> StepChoices:
        """What a plan of this shape would run (no buffers allocated)."""
        return resolve(self.config, self.shape, batch, max_tokens, target_of(torch.device(device)),
                       pages_per_program, block_tokens)

    def plan(self, batch: int, max_tokens: int, device: torch.device | str, pages_per_program: int | None = None,
             block_tokens: int | None = None) -> Plan:
        """Buffers for steps of ``batch`` sequences of at most ``max_tokens`` tokens, and that shape's choices. The
        Key stage runs one program per ``pages_per_program`` pages of a (sequence, KV head) (default: 1024 tokens
        with the FMA Key stage, 4 pages with the MMA ones), the Value passes one per ``block_tokens`` tokens (a
        multiple of the page size; default 1024). Where a 1024-token split leaves fewer than two programs per SM
        (B = 1), the Key stage runs 128-token programs decoding 4 channels at a time and the Value passes 256-token
        blocks."""
        if batch < 1 or max_tokens < 1:
            raise ValueError(f"a plan needs batch >= 1 and max_tokens >= 1, got {batch} x {max_tokens}")
        dev = torch.device(device)
        ch = self.choices(batch, max_tokens, dev, pages_per_program, block_tokens)
        k = self.consts
        hq, hk, d = k.hq, k.hk, k.d
        n_splits = math.ceil(math.ceil(max_tokens / k.p) / ch.key_pages)
        n_blocks = math.ceil(max_tokens / ch.block_tokens)
        groups = batch * hk // k.hg
        f32 = dict(dtype=torch.float32, device=dev)
        f16 = dict(dtype=torch.float16, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.constants(dev)
        r, tp, mma = k.refine, ch.two_pass, ch.key_stage == "int8"
        smax = d * k.w // 16  # steps of 16 pairs a head can need: every channel at full depth

        def opt(on: bool, *shape: int, **kw) -> torch.Tensor:
            """A stage's buffer, or a one-element placeholder when the stage is off."""
            return torch.zeros(*(shape if on else (1,) * len(shape)), **kw)

        pl = Plan(
            batch=batch, max_tokens=max_tokens, n_splits=n_splits, n_blocks=n_blocks, device=dev, choices=ch,
            qbuf=torch.empty(batch, hq, d, **f32), qt=torch.empty(batch, hq, d, **f32),
            w_hi=torch.empty(batch, hq, d, **f16), w_lo=torch.empty(batch, hq, d, **f16),
            wf=torch.empty(batch, hk, d, hq // hk, **f32), base=torch.empty(batch, hq, **f32),
            kdep=torch.empty(batch, hk, d, **i32), kord=torch.zeros(batch, hk, d, **i32),
            kcnt=torch.zeros(batch * hk, KSEG_WORDS, **i32),
            logits=torch.empty(batch, hq, max_tokens, **f32),
            mstat=torch.empty(batch, hq, n_splits, **f32), sstat=torch.empty(batch, hq, n_splits, **f32),
            vimp=torch.empty(batch, hk, max_tokens, **f32),
            vdep=torch.zeros(batch, hk, max_tokens, dtype=torch.int8, device=dev),
            vord=torch.zeros(batch, hk, max_tokens if ch.compact else 1, dtype=torch.int16, device=dev),
            vcnt=torch.zeros(batch, hk, n_blocks if ch.compact else 1, **i32),
            hist=torch.zeros(groups, HIST_STRIDE, **i32),
            ties=torch.zeros(groups, k.hg * n_blocks, k.kspad_v, **i32),
            part=torch.empty(batch, hq, n_blocks, d, **f32), out_t=torch.empty(batch, hq, d, **f32),
            out=torch.empty(batch, hq, d, **f32),
            rhist=opt(r, groups, k.rhw, **i32), rsel=opt(r, groups, RSEL_STRIDE, dtype=torch.int64, device=dev),
            rtie=opt(r, groups, k.hg * n_blocks, **i32), rcnt=opt(r, batch, hk, n_blocks, **i32),
            rord=opt(r, batch, hk, max_tokens, dtype=torch.int16, device=dev), rcost=opt(r, batch * hk, **i32),
            ihist=opt(tp, groups, (k.hg + 1) * IH_BINS, **i32), cmeta=opt(tp, groups, CMETA_WORDS, **i32),
            cand=opt(tp, groups, ch.cand_cap, **i32), cbins=opt(tp, groups, EXACT_BINS, **i32),
            ckeep=opt(ch.exact_chunk > 0, groups, self.config.exact_keep, **i32),
            lin_off=opt(mma, batch * hk, smax, 16, **i32),
            lin_v=opt(mma, batch * hk, smax, 128, dtype=torch.float16, device=dev),
            lin_steps=opt(mma, batch * hk, **i32), lin_base=opt(mma, batch, hq, **f32),
            lin_scale=opt(mma, batch, hq, **f32),
        )
        return self._with_parts(pl)

    def _with_parts(self, pl: Plan) -> Plan:
        """``pl`` split into ``batch_streams`` batch parts of near-equal size (none where that is 1 or the batch
        is 1), each with a stream of its own on a CUDA device; with ``stream_priority`` the earlier parts' streams
        rank higher, so that a part's small per-group kernels are dispatched ahead of the other parts' pending
        programs."""
        n = min(self.config.batch_streams, pl.batch)
        if n == 1:
            return pl
        starts = tuple(round(i * pl.batch / n) for i in range(n + 1))
        parts = tuple(pl.batch_part(starts[i], starts[i + 1]) for i in range(n))
        streams: tuple[torch.cuda.Stream, ...] = ()
        events: tuple[torch.cuda.Event, ...] = ()
        if pl.device.type == "cuda":
            _, top = torch.cuda.Stream.priority_range()  # (lowest, highest): lower numbers rank higher
            prio = [max(top, -(n - 1 - i)) if self.config.stream_priority else 0 for i in range(n)]
            streams = tuple(torch.cuda.Stream(device=pl.device, priority=pr) for pr in prio)
            events = tuple(torch.cuda.Event() for _ in range(n + 1))  # the fork, then each part's join
        pl.parts, pl.part_starts, pl.streams, pl.events = parts, starts[:-1], streams, events
        return pl

    # ---- run ----

    def run(self, plan: Plan, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            page_table: torch.Tensor, lengths: torch.Tensor, layer: int, scale: float | None = None,
            marks: list[tuple[str, torch.cuda.Event]] | None = None, tiers: TieredPools | None = None) -> torch.Tensor:
        """One decode step: q [B, Hq, d]; k_pool [pages, W, d, P/8] and v_pool [pages, W, P, d/8] (uint8, this
        layer's pools; [pages, W/g, P, g, d/8] with the format's ``v_run`` = g > 1); page_table [B, Hkv, slots]
        (int32); lengths [B] (int32, <= plan.max_tokens). Returns plan.out [B, Hq, d] (float32). Allocates
        nothing. ``marks`` (profiling only) receives a recorded CUDA event after each stage. ``tiers``: a tiered
        cache's layer (``k_pool`` / ``v_pool`` are then its hot pools; :meth:`check_tiered`)."""

        def mark(name: str) -> None:
            if marks is not None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((name, ev))

        spec = self.codec.spec
        check_device(q, k_pool, v_pool, page_table, lengths, plan.out)
        if q.dim() != 3 or q.shape[1:] != (spec.n_q_heads, spec.head_dim) or not q.is_floating_point():
            raise ValueError(f"q must be a float tensor [B, {spec.n_q_heads}, {spec.head_dim}], got "
                             f"{q.dtype} {tuple(q.shape)}")
        if tiers is None:
            check_v_pool(v_pool, spec)
        else:
            self.check_tiered(plan, tiers, q.shape[0])
        if q.shape[0] != plan.batch:
            raise ValueError(f"batch {q.shape[0]} != planned batch {plan.batch}")
        mark("start")
        if plan.parts:
            self._run_parts(plan, q, k_pool, v_pool, page_table, lengths, layer, scale)
            mark("parts")
            return plan.out
        cfg = self.config
        st = Step(plan=plan, k=self.consts, c=self._consts[plan.device], layer=layer,
                  scale=1.0 / math.sqrt(spec.head_dim) if scale is None else scale, slots=page_table.shape[2],
                  num_warps=cfg.num_warps, gated_splits=cfg.gated_splits, sample_slack=cfg.sample_slack,
                  sample_z=cfg.sample_z)
        ch = plan.choices
        if tiers is not None:  # a tiered cache: the FMA stages read the hot pools and the promotion cache
            self._run_tiered(st, q, tiers, page_table, lengths, mark)
            return plan.out
        prep.launch(st, q)  # q~, the Key depths and weights
        mark("prep")
        KEY_STAGES[ch.key_stage](st, k_pool, page_table, lengths)  # logits, per-split softmax statistics
        mark("key_stage")
        if st.k.refine:
            refine.launch(st, k_pool, page_table, lengths)  # the chosen tokens' logits at full depth
            mark("refine")
        if not st.k.fixed_depth:  # the Value depths
            if ch.two_pass:
                value_alloc_two_pass.launch(st, lengths)
            value_alloc.launch(st, lengths)
            mark("value_alloc")
        VALUE_STAGES[ch.value_stage](st, v_pool, page_table, lengths)  # per-block weighted sums
        mark("value_stage")
        combine.launch(st)  # the output
        mark("combine")
        return plan.out

    def check_tiered(self, plan: Plan, tiers: TieredPools, batch: int) -> None:
        """Refuse a tiered read this reader cannot run: the FMA Key and Value stages and Key refinement read tiered
        caches (not the int8 / MMA stages, the Full Reader or batch parts), and the pools must fit the format."""
        spec, ch = self.codec.spec, plan.choices
        if ch.key_stage != "fma" or ch.value_stage != "fma":
            raise ValueError(f"a tiered read runs on the FMA stages; this plan chose the {ch.key_stage} Key stage and "
                             f"the {ch.value_stage} Value stage: use ReaderConfig(assembly='fma', key_int8=False, "
                             "value_int8=False)")
        if self.fixed_depth or plan.parts:
            raise ValueError("a tiered read supports neither the Full Reader's fixed depth nor batch parts "
                             "(ReaderConfig.batch_streams > 1) yet")
        w, d, p, g = spec.width, spec.head_dim, spec.page_size, spec.v_run
        if not 0 <= tiers.hot_k <= w or not 0 <= tiers.hot_v <= w or tiers.hot_v % g:
            raise ValueError(f"hot planes K {tiers.hot_k} / V {tiers.hot_v} must lie in [0, W = {w}], V a multiple of "
                             f"v_run = {g}")
        want = {
            "k_hot": (tiers.k_hot, (tiers.hot_k, d, p // 8)), "v_hot": (tiers.v_hot, v_page_shape(spec, tiers.hot_v)),
            "v_promo": (tiers.v_promo, v_page_shape(spec, w - tiers.hot_v)),
            "kp_promo": (tiers.kp_promo, (w - tiers.hot_k, d, p // 8)),
            "k_slot": (tiers.k_slot, (batch, spec.n_kv_heads, d, w - tiers.hot_k)),
            "k_max": (tiers.k_max, (batch, spec.n_kv_heads, d)),
        }
        for name, (t, shape) in want.items():
            got = tuple(t.shape) if name in ("k_slot", "k_max") else tuple(t.shape[1:])
            if got != tuple(shape):
                raise ValueError(f"tiered pools: {name} must be {'' if name in ('k_slot', 'k_max') else '[n, '}"
                                 f"{', '.join(map(str, shape))}{'' if name in ('k_slot', 'k_max') else ']'}, got "
                                 f"{tuple(t.shape)}")
        for name in ("k_slot", "k_max", "v_slot", "kp_slot"):
            if getattr(tiers, name).dtype != torch.int32:
                raise TypeError(f"tiered pools: {name} must be int32")
        check_device(tiers.k_hot, tiers.v_hot, tiers.k_promo, tiers.v_promo, tiers.k_slot, tiers.k_max, tiers.v_slot,
                     tiers.kp_promo, tiers.kp_slot, plan.out)

    def _run_tiered(self, st: Step, q: torch.Tensor, tiers: TieredPools, page_table: torch.Tensor,
                    lengths: torch.Tensor, mark: Callable[[str], None]) -> None:
        ch = st.plan.choices
        prep.launch(st, q, tiers.k_max)  # the Key depths; the channel lists capped at the resident depths
        mark("prep")
        key_stage_fma.launch(st, tiers.k_hot, page_table, lengths, tiers)
        mark("key_stage")
        if st.k.refine:  # refined tokens at depth W on resident Key pages, else at their channels' resident depth
            refine.launch(st, tiers.k_hot, page_table, lengths, tiers)
            mark("refine")
        if ch.two_pass:
            value_alloc_two_pass.launch(st, lengths)
        value_alloc.launch(st, lengths)
        mark("value_alloc")
        value_stage_fma.launch(st, tiers.v_hot, page_table, lengths, tiers)  # depths capped at the pages' residency
        mark("value_stage")
        combine.launch(st)
        mark("combine")

    def _run_parts(self, plan: Plan, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   page_table: torch.Tensor, lengths: torch.Tensor, layer: int, scale: float | None) -> None:
        """A step of ``plan.parts``: each part's sequences on its own stream after a fork event recorded on the
        current stream, which then waits for every part's join event (events and streams made by :meth:`plan`:
        nothing allocated; a CUDA graph captures the fork and join as dependencies). Off the GPU, the parts one
        after the other."""
        cuda = plan.device.type == "cuda"
        if cuda:
            cur = torch.cuda.current_stream(plan.device)
            plan.events[0].record(cur)
        for i, (part, b0) in enumerate(zip(plan.parts, plan.part_starts, strict=True)):
            rows = slice(b0, b0 + part.batch)
            args = (part, q[rows], k_pool, v_pool, page_table[rows], lengths[rows], layer, scale)
            if not cuda:
                self.run(*args)
                continue
            st = plan.streams[i]
            st.wait_event(plan.events[0])
            with torch.cuda.stream(st):
                self.run(*args)
            plan.events[i + 1].record(st)
        if cuda:
            for ev in plan.events[1:]:
                cur.wait_event(ev)

    # ---- convenience ----

    def decode(self, q: torch.Tensor, cache: PlaneKVCache, layer: int, scale: float | None = None,
               plan: Plan | None = None) -> tuple[torch.Tensor, ReadStats]:
        """The same contract as planekv.kvstore.reference.readkv_decode, over a PlaneKVCache."""
        cache.check_format(self.codec.format_id)
        b = q.shape[0]
        lengths = cache.lengths[layer].to(torch.int32)
        t_max = int(lengths.max())
        if plan is None:
            plan = self._cached_plan(b, t_max, q.device)
        elif plan.max_tokens < t_max or plan.batch != b:
            raise ValueError(f"plan for {plan.batch} x {plan.max_tokens} tokens cannot serve {b} x {t_max}")
        pt = cache.page_table.to(device=q.device, dtype=torch.int32).contiguous()
        if pt.shape[2] == 0:
            raise ValueError("the cache holds no pages")
        out = self.run(plan, q, cache.k_pool[layer], cache.v_pool[layer], pt, lengths.to(q.device), layer, scale)
        return out.clone(), self.stats(plan, lengths)

    def decode_rows(self, q: torch.Tensor, cache: PlaneKVCache, layer: int, rows: torch.Tensor,
                    scale: float | None = None) -> tuple[torch.Tensor, ReadStats]:
        """Several query rows per sequence in one run: q [B, Hq, R, d], rows [B, R] (int64) -> out [B, Hq, R, d]
        (float32); row r of sequence b reads the first ``rows[b, r]`` tokens that sequence b stores, as a decode
        step at that length would (each row a sequence of the run, sharing b's pages). A step's tokens, all
        stored, read as causal rows. Stats per row (batch B * R, row-major)."""
        cache.check_format(self.codec.format_id)
        b, hq, r, d = q.shape
        if rows.shape != (b, r):
            raise ValueError(f"rows must be [{b}, {r}] (one length per query row), got {tuple(rows.shape)}")
        lengths = cache.lengths[layer].to(torch.int64)
        flat = rows.to(torch.int64).reshape(-1)  # [B * R]
        if bool((rows < 1).any()) or bool((rows > lengths[:, None]).any()):
            raise ValueError(f"row lengths must lie in 1..the tokens stored ({lengths.tolist()}), got "
                             f"{rows.tolist()}")
        plan = self._cached_plan(b * r, int(flat.max()), q.device)
        pt = cache.page_table.to(device=q.device, dtype=torch.int32).repeat_interleave(r, 0).contiguous()
        qv = q.transpose(1, 2).reshape(b * r, hq, d).contiguous()
        out = self.run(plan, qv, cache.k_pool[layer], cache.v_pool[layer], pt, flat.to(torch.int32).to(q.device),
                       layer, scale)
        return out.clone().view(b, r, hq, d).transpose(1, 2), self.stats(plan, flat)

    def _cached_plan(self, batch: int, t_max: int, device: torch.device) -> Plan:
        """A plan for ``batch`` sequences of up to ``t_max`` tokens, kept per (batch, device) and grown in steps of
        4096 tokens on the GPU so decode steps re-plan rarely; of 256 in Triton's interpreter (CPU tensors), whose
        time grows with the planned tokens, not the stored ones."""
        plan = self._plan_cache.get((batch, device))
        if plan is None or plan.max_tokens < t_max:
            step = 4096 if device.type == "cuda" else 256
            plan = self.plan(batch, -(-t_max // step) * step, device)
            self._plan_cache[(batch, device)] = plan
        return plan

    def decode_tiered(self, q: torch.Tensor, cache: TieredSource, layer: int, scale: float | None = None,
                      plan: Plan | None = None) -> tuple[torch.Tensor, ReadStats]:
        """The same contract as planekv.kvstore.reference.readkv_decode with the cache's residency (depths capped
        at it: ``ReadPolicy.tier_aware`` off), over a tiered cache (``planekv.tiering.TieredCache``)."""
        if self.policy.tier_aware:
            raise ValueError("the Triton reader caps depths at the residency; tier-aware allocation (allocating "
                             "within it) is in the reference reader only")
        cache.check_format(self.codec.format_id)
        b = q.shape[0]
        lengths = cache.lengths[layer].to(torch.int32)
        t_max = int(lengths.max())
        if plan is None:
            plan = self.plan(b, -(-t_max // 256) * 256, q.device)
        elif plan.max_tokens < t_max or plan.batch != b:
            raise ValueError(f"plan for {plan.batch} x {plan.max_tokens} tokens cannot serve {b} x {t_max}")
        pools = cache.pools(layer)
        pt = cache.page_table.to(device=q.device, dtype=torch.int32).contiguous()
        out = self.run(plan, q, pools.k_hot, pools.v_hot, pt, lengths.to(q.device), layer, scale, tiers=pools)
        return out.clone(), self.tiered_stats(plan, lengths, pools, cache.page_table)

    def tiered_stats(self, plan: Plan, lengths: torch.Tensor, pools: TieredPools,
                     page_table: torch.Tensor) -> ReadStats:
        """:meth:`stats` of a tiered run: depths read (capped at the residency), the allocation's depths
        (``k_wanted`` / ``v_wanted``), caps in bits and the bits asked for, as the reference reports them; with Key
        refinement the chosen tokens (``kr_wanted``, the choice is the unlimited one), those read at depth W
        (``kr_full``), their caps (``kr_caps``) and what they cost without a limit (``kr_wanted_bits``).

        Counted on the read's device; on the host: the [B] sums, ``k_depths`` and ``k_wanted`` [B, Hkv, d]. The
        per-token tensors stay on the device (``v_depths`` [B, Hkv, T]; the per-sequence ``v_wanted``,
        ``v_depths``, ``kr_wanted``, ``kr_full`` [Hkv, T_b] and ``k_refined`` [B, Hkv, T]): prefetch and the tally
        reduce them to pages there (``planekv.tiering.demand``)."""
        spec = self.codec.spec
        dev = plan.kdep.device
        p, w, d = spec.page_size, spec.width, spec.head_dim
        n_tok = lengths.to(device=dev, dtype=torch.int64)  # [B]
        kdep, vdep = self._depths(plan, n_tok)  # [B, Hkv, d], [B, Hkv, T] wanted (the allocation, unlimited)
        k_max = pools.k_max.to(device=dev, dtype=torch.int64)  # [B, Hkv, d] resident Key depth per channel
        k_read = torch.minimum(kdep, k_max)
        pt = page_table.to(device=dev, dtype=torch.int64).clamp_min(0)  # [B, Hkv, S]
        page_depth = torch.where(pools.v_slot.to(dev)[pt] >= 0, w, pools.hot_v)  # [B, Hkv, S] resident V depth
        cap = page_depth.repeat_interleave(p, dim=2)[:, :, : plan.max_tokens]
        cap = torch.nn.functional.pad(cap, (0, plan.max_tokens - cap.shape[2]))  # [B, Hkv, T]
        v_read = torch.minimum(vdep, cap)
        k_bits = n_tok * k_read.sum((1, 2))  # [B] int64 until the transfer below
        v_bits = d * v_read.sum((1, 2))
        k_caps = n_tok * (kdep - k_read).sum((1, 2))
        v_caps = d * vdep.sum((1, 2)) - v_bits
        kr_caps = kr_wanted_bits = torch.zeros_like(k_caps)
        t_list = [int(t) for t in lengths.tolist()]
        extra: dict = {}
        if self.refine:
            refined = self._refined(plan)  # [B, Hkv, T] bool, on the device
            kp = pools.kp_slot.to(dev)[pt] >= 0  # [B, Hkv, S]: Key page on the device
            whole = kp.repeat_interleave(p, dim=2)[:, :, : plan.max_tokens]
            whole = torch.nn.functional.pad(whole, (0, plan.max_tokens - whole.shape[2]))
            cost_w = (w - k_read).sum(-1)  # [B, Hkv] bits of a token at depth W
            cost_r = (k_max - k_read).sum(-1)  # at the channels' resident depths
            n_full = (refined & whole).sum(-1)
            n_cap = (refined & ~whole).sum(-1)
            k_bits = k_bits + (n_full * cost_w + n_cap * cost_r).sum(-1)
            kr_caps = (n_cap * (w - k_max).sum(-1)).sum(-1)
            kr_wanted_bits = (refined.sum(-1) * cost_w).sum(-1)
            extra.update(k_refined=refined, kr_wanted=[refined[b, :, :t] for b, t in enumerate(t_list)],
                         kr_full=[(refined & whole)[b, :, :t] for b, t in enumerate(t_list)])
        # one transfer for every [B] sum (int64 counts: exact as doubles far past any cache's size)
        k_bits, v_bits, k_caps, v_caps, kr_caps, kr_wanted_bits = torch.stack(
            [k_bits, v_bits, k_caps, v_caps, kr_caps, kr_wanted_bits]).cpu().double()
        if self.refine:
            extra.update(kr_caps=kr_caps, kr_wanted_bits=kr_wanted_bits)
        extra.update({"k_wanted": kdep.cpu(), "v_wanted": [vdep[b, :, :t] for b, t in enumerate(t_list)],
                      "v_depths": [v_read[b, :, :t] for b, t in enumerate(t_list)],
                      "k_caps": k_caps, "v_caps": v_caps, "kr_caps": kr_caps,
                      "wanted_bits": k_bits + v_bits + k_caps + v_caps + kr_caps})
        return ReadStats(
            k_bits=k_bits, v_bits=v_bits, tokens=lengths.to(torch.int64).cpu().double(), n_kv_heads=spec.n_kv_heads,
            head_dim=d, workspace_bytes=two_stage_workspace_bytes(spec.n_q_heads, spec.n_kv_heads, max(t_list), d,
                                                                  plan.batch),
            k_depths=k_read.cpu(), v_depths=v_read, extra=extra)

    def _depths(self, plan: Plan, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last run's depth buffers as int64 on ``lengths``' device: Key [B, Hkv, d] and Value [B, Hkv, T]
        (0 past each sequence's ``lengths`` [B]; the Full Reader's fixed depth for every stored token)."""
        dev = lengths.device
        kdep = plan.kdep.to(device=dev, dtype=torch.int64)
        vdep = plan.vdep.to(device=dev, dtype=torch.int64)
        if self.fixed_depth:
            vdep = torch.full_like(vdep, self.fixed_depth)
        vmask = torch.arange(plan.max_tokens, device=dev)[None, None, :] < lengths[:, None, None]
        return kdep, vdep * vmask

    def stats(self, plan: Plan, lengths: torch.Tensor) -> ReadStats:
        """Logical read of the last run, counted from its depth buffers."""
        spec = self.codec.spec
        lengths = lengths.to(torch.int64).cpu()
        kdep, vdep = self._depths(plan, lengths)
        k_bits = (lengths * kdep.sum((1, 2))).double()
        refined = self.refined(plan) if self.refine else None
        if refined is not None:  # chosen tokens x the bits to refine one token of their head
            n_ref = refined.sum(2).to(torch.int64)  # [B, Hkv]
            k_bits = k_bits + (n_ref * plan.rcost.cpu().to(torch.int64).view(plan.batch, -1)).sum(1).double()
        v_bits = (spec.head_dim * vdep.sum((1, 2))).double()
        return ReadStats(
            k_bits=k_bits, v_bits=v_bits, tokens=lengths.double(), n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            workspace_bytes=two_stage_workspace_bytes(spec.n_q_heads, spec.n_kv_heads, int(lengths.max()),
                                                      spec.head_dim, plan.batch),
            k_depths=kdep, v_depths=vdep,
            extra={} if refined is None else {"k_refined": refined},
        )

    def refined(self, plan: Plan) -> torch.Tensor:
        """The tokens whose Keys the last run's refinement read at depth W: [B, Hkv, T] bool (CPU)."""
        return self._refined(plan).cpu()

    def _refined(self, plan: Plan) -> torch.Tensor:
        """:meth:`refined` on the plan's device."""
        if not self.refine:
            raise ValueError("this reader's policy has no Key refinement")
        b, hk, tmax = plan.rord.shape
        blk = plan.choices.block_tokens
        nblk = plan.n_blocks
        dev = plan.rord.device
        lp = torch.nn.functional.pad(plan.rord.to(torch.int64), (0, nblk * blk - tmax)).view(b, hk, nblk, blk)
        take = torch.arange(blk, device=dev)[None, None, None, :] < plan.rcnt.to(torch.int64)[..., None]
        pos = torch.where(take, lp + (torch.arange(nblk, device=dev) * blk)[None, None, :, None], nblk * blk)
        out = torch.zeros(b, hk, nblk * blk + 1, dtype=torch.bool, device=dev)
        out.scatter_(2, pos.view(b, hk, -1), True)
        return out[:, :, :tmax]


_READERS: dict[tuple[str, ReadPolicy], TritonReader] = {}


def readkv_decode(q: torch.Tensor, cache: PlaneKVCache, layer: int, codec: Codec, policy: ReadPolicy,
                  scale: float | None = None) -> tuple[torch.Tensor, ReadStats]:
    """Drop-in for planekv.kvstore.reference.readkv_decode through the Triton kernels (one reader and its plans
    kept per format and policy)."""
    return _reader_for(codec, policy).decode(q, cache, layer, scale)


def readkv_decode_rows(q: torch.Tensor, cache: PlaneKVCache, layer: int, codec: Codec, policy: ReadPolicy,
                       rows: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, ReadStats]:
    """:meth:`TritonReader.decode_rows` with the reader :func:`readkv_decode` keeps for this format and policy:
    q [B, Hq, R, d], rows [B, R] (the tokens each query row reads) -> out [B, Hq, R, d], stats per row."""
    return _reader_for(codec, policy).decode_rows(q, cache, layer, rows, scale)


def _reader_for(codec: Codec, policy: ReadPolicy) -> TritonReader:
    """The reader kept for this format and policy (made on first use)."""
    key = (codec.format_id, policy)
    reader = _READERS.get(key)
    if reader is None:
        reader = _READERS[key] = TritonReader(codec, policy)
    return reader
