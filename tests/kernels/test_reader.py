"""Triton two-stage reader (interpreter) against the reference reader: same depths, same bits,
outputs within float32 tolerance, fresh random inputs, outputs poisoned before each run."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from planekv.kernels import Encoder, ReaderConfig, TritonReader
from planekv.kernels import reader as reader_mod
from planekv.kernels.config import Target
from planekv.kvstore import Codec, PlaneKVCache, ReadPolicy
from planekv.kvstore.reference import attention, readkv_decode
from planekv.kvstore.synthetic import make_synthetic

POLICIES = {
    "flexible-r4": ReadPolicy.flexible(4.0),
    "flexible-r2-k0.3": ReadPolicy.flexible(2.0, k_share=0.3),
    "constrained-r2": ReadPolicy.constrained(2.0),
    "explicit-budgets": ReadPolicy(rate=None, budget_k=150, budget_v=300, pool_heads=False),
    "flexible-r2-head-weight": ReadPolicy.flexible(2.0, value_head_weight=True),
}


def assert_same_depths(kernel: torch.Tensor, ref: torch.Tensor, step: int = 1) -> None:
    """Equal depths, except that gains within float32 rounding of lambda (the kernel ranks float32
    gains, the reference float64) may swap one step between two items: at most one such swap."""
    diff = (kernel.long() - ref.long()).flatten()
    moved = diff[diff != 0]
    assert moved.numel() in (0, 2), f"{moved.numel()} depths differ"
    if moved.numel():
        assert sorted(moved.tolist()) == [-step, step]


def _setup(seed: int, lengths: list[int], hq: int = 4, hk: int = 2, d: int = 32,
           codebook: str = "gaussian-lloyd-tree", v_run: int = 1):
    syn = make_synthetic(n_tokens=max(lengths), n_rows=len(lengths), n_layers=1, n_q_heads=hq, n_kv_heads=hk,
                         head_dim=d, seed=seed)
    spec = dataclasses.replace(syn.spec, codebook=codebook, v_run=v_run)
    codec = Codec(spec, syn.calibration)
    cache = PlaneKVCache(spec, len(lengths))
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    for b, t in enumerate(lengths):
        cache.append(0, kc[:, :t], vc[:, :t], seq=b)
    q = syn.q[0].transpose(0, 1).contiguous()  # [B, Hq, d]
    return codec, cache, q


@pytest.mark.parametrize("name", list(POLICIES))
def test_reader_matches_reference(name: str) -> None:
    policy = POLICIES[name]
    codec, cache, q = _setup(seed=zlib.crc32(name.encode()) % 1000, lengths=[150, 97])
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    reader = TritonReader(codec, policy)
    plan = reader.plan(2, 150, "cpu")
    plan.out.fill_(float("nan"))  # poison: every element must be written
    out, st = reader.decode(q, cache, 0, plan=plan)
    assert torch.isfinite(out).all()
    assert_same_depths(st.k_depths, rst.k_depths)
    swapped = False
    for b in range(2):
        kv, rv = st.v_depths[b, :, : cache.length(0, b)], rst.extra["v_depths"][b]
        assert_same_depths(kv, rv, policy.v_packet)
        swapped |= not torch.equal(kv, rv)
    swapped |= not torch.equal(st.k_depths, rst.k_depths)
    assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)  # the budget, exactly
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < (1e-3 if swapped else 1e-5), rel


@pytest.mark.parametrize("name", ["flexible-r2-k0.3", "constrained-r2"])
def test_reader_matches_reference_with_the_linear_codebook(name: str) -> None:
    """The kernels read any named codebook through its tables and split thresholds: with the
    linear one (uniform-linear-c3) the encode kernel writes the codec's codes and the decode step
    gives the reference reader's depths and output (the encode kernel: the test below)."""
    policy = POLICIES[name]
    codec, cache, q = _setup(seed=zlib.crc32(name.encode()) % 997 + 11, lengths=[150, 97],
                             codebook="uniform-linear-c3")
    assert codec.tree.name == "uniform-linear-c3"
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    reader = TritonReader(codec, policy)
    plan = reader.plan(2, 150, "cpu")
    plan.out.fill_(float("nan"))
    out, st = reader.decode(q, cache, 0, plan=plan)
    assert_same_depths(st.k_depths, rst.k_depths)
    assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("assembly", ["transpose", "fma"])
def test_full_reader_kernel_is_attention_over_depth4(assembly: str) -> None:
    codec, cache, q = _setup(seed=7, lengths=[130])
    out, st = TritonReader(codec, fixed_depth=4, config=ReaderConfig(assembly=assembly)).decode(q, cache, 0)
    kk = codec.decode(cache.read_k(0, 0, 8), 4, 0, "k")
    vv = codec.decode(cache.read_v(0, 0, 8), 4, 0, "v")
    ref = attention(q[0][:, None], kk, vv, torch.tensor([130]))[:, 0]
    assert ((out[0] - ref).norm() / ref.norm()).item() < 1e-5
    assert st.bits_per_scalar == pytest.approx(4.0)


def test_mqa_geometry() -> None:
    codec, cache, q = _setup(seed=3, lengths=[70], hq=4, hk=1, d=32)
    pol = ReadPolicy.flexible(3.0)
    ref, rst = readkv_decode(q, cache, 0, codec, pol)
    out, st = TritonReader(codec, pol).decode(q, cache, 0)
    assert torch.equal(st.k_depths, rst.k_depths)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_query_and_output_transforms_in_the_kernels_equal_the_torch_gemms() -> None:
    """q~ computed by _prep and the output rotated back by _combine (the default) give the depths and,
    within float32 rounding, the output of the copy + torch.mm form; q may be fp16 and strided, and a
    group's query rows (here 2 KV heads x 3) are padded to the product's 16."""
    codec, cache, q = _setup(seed=21, lengths=[90, 61], hq=6, hk=2, d=64)
    pol = ReadPolicy.flexible(2.0)
    qh = q.half().transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hq, d], not contiguous
    outs, deps = [], []
    for fuse in (True, False):
        reader = TritonReader(codec, pol, config=ReaderConfig(fuse_transforms=fuse))
        plan = reader.plan(2, 90, "cpu")
        plan.out.fill_(float("nan"))
        plan.qt.fill_(float("nan"))  # poison: _prep must write every row it reads
        out, st = reader.decode(qh, cache, 0, plan=plan)
        outs.append(out)
        deps.append((st.k_depths, st.v_depths))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(deps[0][0], deps[1][0]) and torch.equal(deps[0][1], deps[1][1])
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 1e-6
    args = (cache.k_pool[0], cache.v_pool[0], cache.page_table.to(torch.int32), cache.lengths[0].to(torch.int32), 0)
    with pytest.raises(ValueError, match="q must be"):
        reader.run(plan, qh[:, :4], *args)
    with pytest.raises(ValueError, match="fuse_transforms"):
        ReaderConfig(fuse_transforms="always")
    # auto: by head dim, where it measured faster
    fused = [TritonReader(_setup(seed=1, lengths=[8], d=d, hk=1)[0], pol).choices(1, 64, "cpu").fuse_transforms
             for d in (64, 128, 256)]
    assert fused == [True, True, False]


@pytest.mark.parametrize("codebook,v_run", [("gaussian-lloyd-tree", 1), ("uniform-linear-c3", 1),
                                           ("uniform-linear-c3", 4)])
def test_encode_kernel_writes_the_reference_layout(codebook: str, v_run: int) -> None:
    syn = make_synthetic(n_tokens=100, n_rows=1, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, seed=11)
    spec = dataclasses.replace(syn.spec, codebook=codebook, v_run=v_run)
    codec = Codec(spec, syn.calibration)
    k = syn.k[0][None].expand(2, -1, -1, -1).contiguous()
    v = syn.v[0][None].expand(2, -1, -1, -1).contiguous()
    ref, tri = PlaneKVCache(spec, 2), PlaneKVCache(spec, 2)
    enc = Encoder(codec)
    for a, e in [(0, 37), (37, 38), (38, 100)]:  # prefill, one decode token, a chunk crossing a page
        ref.append(0, codec.encode_k(k[:, :, a:e], 0), codec.encode_v(v[:, :, a:e], 0))
        enc.append(tri, 0, k[:, :, a:e], v[:, :, a:e])
    for b in range(2):
        # codes may differ only where z sits within float rounding of a threshold
        for x, y in ((ref.read_k(0, b, 8), tri.read_k(0, b, 8)), (ref.read_v(0, b, 8), tri.read_v(0, b, 8))):
            assert (x != y).float().mean().item() < 1e-4


@pytest.mark.parametrize("v_run,d,kind,compact", [(4, 64, "transpose", False), (2, 64, "fma", True),
                                                  (8, 256, "transpose", True), (4, 64, "transpose", True)])
def test_value_stages_read_the_v_run_layouts(v_run: int, d: int, kind: str, compact: bool) -> None:
    """The same keys and values stored with each token's V planes in runs of ``v_run`` rows: every Value
    stage (FMA; MMA with bit-serial tiles at d = 64 or transposing ones at d = 256; every token or the
    depth > 0 ones) reads the same bits, so the
    depths and outputs equal those of the plane-major format and the reference reader's; a pool of the
    other layout is refused."""
    lengths = [150, 97]
    hk = 1 if d > 128 else 2
    codec, cache, q = _setup(seed=40 + v_run, lengths=lengths, d=d, hk=hk, v_run=v_run)
    codec1, cache1, _ = _setup(seed=40 + v_run, lengths=lengths, d=d, hk=hk)
    assert cache.v_pool.shape[2:4] == (8 // v_run, 64) and torch.equal(cache.read_v(0, 1, 8), cache1.read_v(0, 1, 8))
    policy = ReadPolicy.flexible(4.0)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    outs = []
    for cd, ch in ((codec, cache), (codec1, cache1)):
        reader = TritonReader(cd, policy, config=ReaderConfig(assembly=kind, compact_values=compact))
        plan = reader.plan(2, 150, "cpu")
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, ch, 0, plan=plan)
        outs.append((out.clone(), st))
    (og, sg), (o1, s1) = outs
    assert int(sg.v_depths.max()) >= 4
    assert torch.equal(sg.v_depths, s1.v_depths) and torch.equal(sg.k_depths, s1.k_depths)
    torch.testing.assert_close(og, o1, rtol=0, atol=0)
    assert ((og - ref).norm() / ref.norm()).item() < 1e-5
    pt = cache.page_table.to(torch.int32)
    with pytest.raises(ValueError, match="v_run"):
        reader.run(plan, q, cache1.k_pool[0], cache.v_pool[0], pt, torch.tensor(lengths, dtype=torch.int32), 0)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from planekv.kernels._dispatch import check_device

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        check_device(torch.zeros(1))


def test_ties_at_lambda_follow_the_reference_order() -> None:
    """Peaked queries make most probabilities underflow to exactly 0, so many Value importances are
    exactly equal (0) in any arithmetic; a budget beyond the positive gains puts lambda on those
    ties, and the kernel must take them in the reference's (step, item) order."""
    codec, cache, q = _setup(seed=21, lengths=[150])
    q = q * 300.0  # softmax one-hot per head: p = 0 exactly for almost every token
    for policy in (ReadPolicy(rate=None, budget_k=256, budget_v=101, pool_heads=True),
                   ReadPolicy(rate=None, budget_k=300, budget_v=91, pool_heads=False),
                   ReadPolicy(rate=None, budget_k=128, budget_v=211, pool_heads=False, min_depth_v=1, v_packet=2)):
        ref, rst = readkv_decode(q, cache, 0, codec, policy)
        dep = rst.extra["v_depths"][0]
        zero = dep[dep <= policy.min_depth_v + policy.v_packet]  # the tie-broken tokens
        assert (zero > policy.min_depth_v).any() and (zero == policy.min_depth_v).any()  # the split happens
        out, st = TritonReader(codec, policy).decode(q, cache, 0)
        assert torch.equal(st.v_depths[0, :, :150], dep)
        assert torch.equal(st.v_bits, rst.v_bits) and torch.equal(st.k_depths, rst.k_depths)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_readkv_decode_is_a_drop_in_for_the_reference() -> None:
    from planekv.kernels import readkv_decode as triton_decode

    codec, cache, q = _setup(seed=5, lengths=[90, 64])
    pol = ReadPolicy.flexible(4.0)
    ref, rst = readkv_decode(q, cache, 0, codec, pol, scale=0.1)
    out, st = triton_decode(q, cache, 0, codec, pol, scale=0.1)
    assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # its plan, kept for the next steps, grows in steps of 256 tokens off the GPU (4096 on it)
    assert reader_mod._READERS[(codec.format_id, pol)]._plan_cache[(2, q.device)].max_tokens == 256


@pytest.mark.parametrize("pages_per_program,d", [(4, 256), (2, 64)])
def test_mma_assembly_equals_the_fma_one(pages_per_program: int, d: int) -> None:
    """The two assemblies of the Key and Value stages (fp16 MMAs of table values over bit-transposed codes;
    float32 FMAs on the CUDA cores over the depth > 0 channels) write the same logits and softmax statistics
    and the same depths and output, within float32 summation order, for sequences that end mid-page and
    channels and tokens of every depth; the MMA Value stage's tiles are bit-transposed at d >= 256 only."""
    codec, cache, q = _setup(seed=101 + pages_per_program, lengths=[150, 97, 64], d=d, hk=1 if d > 128 else 2)
    policy = ReadPolicy.flexible(5.0)
    ref, _ = readkv_decode(q, cache, 0, codec, policy)
    runs = {}
    for kind in ("transpose", "fma"):
        reader = TritonReader(codec, policy, config=ReaderConfig(assembly=kind))
        plan = reader.plan(3, 150, "cpu", pages_per_program=pages_per_program)
        assert plan.choices.key_stage == kind and plan.choices.value_transposing == (d >= 256)
        plan.logits.fill_(float("nan"))
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[kind] = (plan.logits.clone(), plan.mstat.clone(), plan.sstat.clone(), out.clone(), st)
    (lt, mt, st_, ot, stt), (lf, mf, sf, of, stf) = runs["transpose"], runs["fma"]
    assert int(stt.v_depths.max()) >= 4 and int((stt.v_depths[0, :, :150] == 0).sum()) > 0
    assert int(stt.k_depths.max()) >= 6 and int(stt.k_depths.min()) <= 2  # shallow and deep channels
    for b, t in enumerate([150, 97, 64]):
        assert torch.isfinite(lt[b, :, :t]).all()
        torch.testing.assert_close(lf[b, :, :t], lt[b, :, :t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mf, mt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sf, st_, rtol=1e-5, atol=1e-5)
    assert torch.equal(stf.k_depths, stt.k_depths) and torch.equal(stf.v_depths, stt.v_depths)
    for out in (ot, of):
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("name,hq,hk,compact", [("flexible-r2-k0.3", 4, 2, True), ("constrained-r2", 4, 4, False),
                                                ("explicit-budgets", 16, 2, True), ("flexible-r4", 3, 1, False),
                                                ("flexible-r2-head-weight", 4, 2, None)])
def test_fma_stages_match_the_reference(name: str, hq: int, hk: int, compact: bool | None) -> None:
    """The FMA Key and Value stages for group sizes 2, 1 (MHA), 8 and 3, sequences ending mid-page,
    a Key program of 2 pages (so a sequence spans several programs), Value tiles over the depth > 0
    tokens (compact) or over every position: same depths and output as the reference reader, every
    logit written."""
    policy = POLICIES[name]
    codec, cache, q = _setup(seed=zlib.crc32(name.encode()) % 997 + hq, lengths=[150, 97], hq=hq, hk=hk)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    config = ReaderConfig(assembly="fma", compact_values="auto" if compact is None else compact)
    reader = TritonReader(codec, policy, config=config)
    plan = reader.plan(2, 150, "cpu", pages_per_program=2)
    plan.out.fill_(float("nan"))
    plan.logits.fill_(float("nan"))
    out, st = reader.decode(q, cache, 0, plan=plan)
    for b, t in enumerate([150, 97]):
        assert torch.isfinite(plan.logits[b, :, :t]).all()
    assert_same_depths(st.k_depths, rst.k_depths)
    swapped = not torch.equal(st.k_depths, rst.k_depths)
    for b in range(2):
        kv, rv = st.v_depths[b, :, : cache.length(0, b)], rst.extra["v_depths"][b]
        assert_same_depths(kv, rv, policy.v_packet)
        swapped |= not torch.equal(kv, rv)
    assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < (1e-3 if swapped else 1e-5), rel


def test_fma_stages_refuse_groups_over_8_and_the_default_falls_back() -> None:
    codec, _, _ = _setup(seed=3, lengths=[8], hq=32, hk=2)
    with pytest.raises(ValueError, match="8 query heads"):
        TritonReader(codec, config=ReaderConfig(assembly="fma"))
    assert TritonReader(codec).assembly == "transpose"  # G = 16: the MMA stages
    assert TritonReader(_setup(seed=3, lengths=[8])[0]).assembly == "fma"


def test_transposing_key_stage_refuses_a_tile_it_cannot_transpose() -> None:
    """The MMA Key stage's tile is pages_per_program x P / 8 rows, 16 to 64 (the MMA's minimum, the
    registers' limit): a plan with 8 rows is refused with the rule, before anything runs."""
    codec, _, _ = _setup(seed=5, lengths=[70])
    reader = TritonReader(codec, ReadPolicy.flexible(4.0), config=ReaderConfig(assembly="transpose"))
    assert reader.plan(1, 70, "cpu").choices.key_stage == "transpose"  # 4 pages: 32 rows
    with pytest.raises(ValueError, match="16, 32 or 64 rows"):
        reader.plan(1, 70, "cpu", pages_per_program=1)  # 64 / 8 = 8 rows
    with pytest.raises(ValueError, match="assembly"):
        ReaderConfig(assembly="lut")


def test_reversed_table_is_indexed_by_bit_reversed_codes() -> None:
    from planekv.kernels.tables import packed_table, reversed_table, reversed_table_f32

    codec, _, _ = _setup(seed=1, lengths=[8])
    w = codec.width
    tab, tabr = packed_table(codec).view(w + 1, -1), reversed_table(codec).view(w + 1, -1)
    exact, tabf = codec.tree.table().float(), reversed_table_f32(codec).view(w + 1, -1)
    for t, c in [(3, 0b10100000), (8, 0b11010010), (1, 0b10000000), (5, 0b01101000)]:
        rev = int(f"{c:0{w}b}"[::-1], 2)
        assert tabr[t, rev] == tab[t, c]
        assert tabf[t, rev] == exact[t, c]  # the FMA stages' float32 table: the tree's values


@pytest.mark.parametrize("d,assembly", [(64, "transpose"), (256, "transpose"), (64, "fma"), (256, "fma")])
def test_value_compaction_skips_depth0_tokens_and_keeps_the_output(d: int, assembly: str) -> None:
    """The compacting Value stage (tokens of depth > 0 only: sorted by depth for the MMA stage, in
    position order for the FMA stage) gives the same depths and, up to float32 summation order, the
    same output as the one that walks every position; at R = 2 with most of the budget on Keys most
    tokens have Value depth 0."""
    codec, cache, q = _setup(seed=77 + d, lengths=[150, 97], d=d, hk=1 if d > 128 else 2)
    policy = ReadPolicy.flexible(2.0, k_share=0.875)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    runs = {}
    for compact in (False, True):
        reader = TritonReader(codec, policy, config=ReaderConfig(compact_values=compact, assembly=assembly))
        plan = reader.plan(2, 150, "cpu")
        plan.part.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[compact] = (plan.part.clone(), out.clone(), st, plan.vord.clone())
    (p0, o0, s0, _), (p1, o1, s1, vord) = runs[False], runs[True]
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-6)
    assert torch.equal(s0.v_depths, s1.v_depths)
    depths = s1.v_depths[0, 0, :150]
    assert 0 < int((depths > 0).sum()) < 150 // 2  # sparse: most tokens cost nothing
    # block 0 of (sequence 0, head 0): the stored order lists the nonzero tokens, deepest first
    nz = int((depths > 0).sum())
    keys = vord[0, 0, :nz].long()
    got_depth = codec.width - (keys >> 11)
    got_pos = keys & 2047
    assert sorted(got_pos.tolist()) == torch.nonzero(depths > 0).flatten().tolist()
    assert torch.equal(got_depth, depths[got_pos].long())
    if assembly == "transpose":  # deepest first
        assert bool((got_depth[:-1] >= got_depth[1:]).all())
    else:  # position order
        assert bool((got_pos[:-1] < got_pos[1:]).all())
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-6)
    assert ((o1 - ref).norm() / ref.norm()).item() < 1e-5


def test_compaction_is_chosen_where_it_was_measured_faster() -> None:
    """compact_values="auto": the FMA stages (the default) always compact (every policy measured was
    faster); the MMA stages compact sparse Value reads (mean depth <= 1 plane, no minimum) and
    d >= 256 only. Never the Full Reader; explicit choices win."""
    codec, _, _ = _setup(seed=1, lengths=[8])  # d = 64
    for pol in (ReadPolicy.flexible(2.0, k_share=0.875), ReadPolicy.flexible(4.0, k_share=0.75),
                ReadPolicy.constrained(2.0)):
        assert TritonReader(codec, pol).compact_values
    off = ReaderConfig(compact_values=False)
    assert not TritonReader(codec, ReadPolicy.constrained(2.0), config=off).compact_values
    mma, mma_on = ReaderConfig(assembly="transpose"), ReaderConfig(assembly="transpose", compact_values=True)
    assert TritonReader(codec, ReadPolicy.flexible(2.0, k_share=0.875), config=mma).compact_values  # 0.5 plane
    assert not TritonReader(codec, ReadPolicy.flexible(4.0, k_share=0.75), config=mma).compact_values  # 2 planes
    assert not TritonReader(codec, ReadPolicy.constrained(2.0), config=mma).compact_values  # minimum depth 1
    assert not TritonReader(codec, fixed_depth=4, config=ReaderConfig(compact_values=True)).compact_values
    assert TritonReader(codec, ReadPolicy.flexible(4.0, k_share=0.75), config=mma_on).compact_values
    codec256, _, _ = _setup(seed=1, lengths=[8], d=256, hk=1)
    assert TritonReader(codec256, ReadPolicy.flexible(4.0, k_share=0.75), config=mma).compact_values


@pytest.mark.parametrize("key_loop", [0, 1])
def test_key_channel_list_and_both_walks(key_loop: int) -> None:
    """The FMA Key stage walks each head's channels of depth > 0 from ``kord``: by-depth (0) in
    segments of one depth, deepest first (one unmasked loop per depth), by-channel (1) in channel order
    (a branch per channel to its depth's body); ``kcnt[:, t]`` holds how many channels have depth t
    and ``kcnt[:, 0]`` the list's length. Every read channel is listed once, and both walks give the
    reference reader's output."""
    codec, cache, q = _setup(seed=5, lengths=[150, 97])
    policy = ReadPolicy.flexible(4.0, k_share=0.75)
    ref, _ = readkv_decode(q, cache, 0, codec, policy)
    walk = ("by-depth", "by-channel")[key_loop]
    reader = TritonReader(codec, policy, config=ReaderConfig(assembly="fma", key_walk=walk))
    plan = reader.plan(2, 150, "cpu")
    assert plan.choices.key_walk == key_loop
    plan.out.fill_(float("nan"))
    out, _ = reader.decode(q, cache, 0, plan=plan)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    w = codec.width
    depths_seen = set()
    for b in range(2):
        for h in range(cache.spec.n_kv_heads):
            dep = plan.kdep[b, h].long()
            seg = plan.kcnt[b * cache.spec.n_kv_heads + h].long()
            n = int(seg[0])
            ent = plan.kord[b, h, :n].long()
            t, ch = ent >> 8, ent & 0xFF
            assert n == int((dep > 0).sum())
            assert [int(seg[k]) for k in range(1, w + 1)] == [int((dep == k).sum()) for k in range(1, w + 1)]
            assert sorted(ch.tolist()) == torch.nonzero(dep > 0).flatten().tolist()
            assert torch.equal(t, dep[ch])
            if key_loop == 0:
                assert bool((t[:-1] >= t[1:]).all())  # deepest first
            else:
                assert bool((ch[:-1] < ch[1:]).all())  # channel order
            depths_seen.update(t.tolist())
    assert len(depths_seen) >= 3  # several depths (segments, branches) ran


def test_key_walk_is_chosen_by_step_size() -> None:
    """key_walk="auto": channel order from 2^18 (sequence, KV head, token) triples (measured faster at B=32
    T=32768), depth segments below and for the Full Reader; bad values are refused."""
    codec, _, _ = _setup(seed=5, lengths=[150, 97])  # 2 KV heads
    reader = TritonReader(codec, ReadPolicy.flexible(2.0))
    assert reader.choices(128, 32768, "cpu").key_walk == 1 and reader.choices(4, 8192, "cpu").key_walk == 0
    assert TritonReader(codec, fixed_depth=4).choices(128, 32768, "cpu").key_walk == 0
    with pytest.raises(ValueError, match="key_walk"):
        ReaderConfig(key_walk="zigzag")


@pytest.mark.parametrize("sms", [132, 1])
def test_program_sizes_follow_the_step_size(monkeypatch: pytest.MonkeyPatch, sms: int) -> None:
    """A step that leaves fewer than two 1024-token programs per SM (B = 1 on an H200's 132) runs
    128-token Key programs decoding 4 channels at a time and 256-token Value blocks; a larger one
    (here: one SM) 1024-token programs, one channel at a time. Both give the reference reader's
    depths and output."""
    monkeypatch.setattr(reader_mod, "target_of", lambda dev: Target(False, sms))
    codec, cache, q = _setup(seed=8, lengths=[300, 129])
    policy = ReadPolicy.flexible(2.0)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    reader = TritonReader(codec, policy, config=ReaderConfig(key_walk="by-depth"))
    plan = reader.plan(2, 300, "cpu")
    small = sms == 132
    assert (plan.choices.key_channels, plan.n_splits, plan.n_blocks) == ((4, 3, 2) if small else (1, 1, 1))
    plan.out.fill_(float("nan"))
    out, st = reader.decode(q, cache, 0, plan=plan)
    assert_same_depths(st.k_depths, rst.k_depths)
    for b in range(2):
        assert_same_depths(st.v_depths[b, :, : cache.length(0, b)], rst.extra["v_depths"][b], policy.v_packet)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("policy,alloc", [
    (ReadPolicy.flexible(2.0, k_share=0.3), None),
    (ReadPolicy.constrained(2.0), "two-pass"),
    (ReadPolicy.flexible(2.0, 0.875, key_refine=0.3), None),
], ids=["flexible", "constrained-two-pass", "key-refinement"])
def test_batch_parts_give_the_unsplit_step(policy: ReadPolicy, alloc: str | None) -> None:
    """``batch_streams``: the step as batch parts (each on its own stream on the GPU; here one after the
    other) over views of one plan's buffers gives every sequence the unsplit step's depths, bits and
    output bit for bit, and the plan's stats still cover the whole batch."""
    lengths = [150, 97, 40]
    codec, cache, q = _setup(seed=33, lengths=lengths)
    runs = []
    for streams in (1, 2):
        reader = TritonReader(codec, policy, config=ReaderConfig(value_alloc=alloc or "auto", batch_streams=streams))
        plan = reader.plan(3, 150, "cpu", block_tokens=cache.spec.page_size)
        assert [p.batch for p in plan.parts] == ([2, 1] if streams == 2 else [])
        plan.out.fill_(float("nan"))
        plan.logits.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs.append((out, st, plan))
    (o1, s1, p1), (o2, s2, p2) = runs
    assert torch.isfinite(o2).all()
    assert torch.equal(o1, o2)
    assert torch.equal(s1.k_depths, s2.k_depths) and torch.equal(s1.v_depths, s2.v_depths)
    assert torch.equal(s1.k_bits, s2.k_bits) and torch.equal(s1.v_bits, s2.v_bits)
    if policy.key_refine:
        assert torch.equal(s1.extra["k_refined"], s2.extra["k_refined"])
    # the second part's buffers are rows of the plan's own: its sequence 0 is the plan's sequence 2
    second = p2.parts[1]
    assert second.kdep.data_ptr() == p2.kdep[2].data_ptr() and second.out.data_ptr() == p2.out[2].data_ptr()
    assert second.hist.data_ptr() == p2.hist[2 * codec.spec.n_kv_heads // reader.consts.hg].data_ptr()
    ref, _ = readkv_decode(q, cache, 0, codec, policy)
    assert ((o2 - ref).norm() / ref.norm()).item() < 1e-3


def test_batch_parts_are_checked() -> None:
    codec, cache, q = _setup(seed=34, lengths=[64, 64])
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="batch_streams"):
            ReaderConfig(batch_streams=bad)
    reader = TritonReader(codec, ReadPolicy.flexible(2.0), config=ReaderConfig(batch_streams=4))
    plan = reader.plan(2, 64, "cpu")  # more parts than sequences: one per sequence
    assert [p.batch for p in plan.parts] == [1, 1] and plan.part_starts == (0, 1)
    with pytest.raises(ValueError, match="outside"):
        plan.batch_part(1, 3)
    with pytest.raises(ValueError, match="planned batch"):
        reader.run(plan, q[:1], cache.k_pool[0], cache.v_pool[0], cache.page_table[:1].to(torch.int32),
                   cache.lengths[0][:1].to(torch.int32), 0)


def test_batch_parts_fork_and_join_on_their_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's order (no GPU here: streams and events are stand-ins that log): a fork event on the
    current stream; each part's stream waits for it, runs its part inside its own stream context and
    records its join event; the current stream waits for every join. Streams rank by part (earlier
    higher) unless stream_priority is off. The parts' outputs are still the unsplit step's."""
    log: list[tuple] = []

    class Stream:
        def __init__(self, device=None, priority=0) -> None:
            self.priority, self.name = priority, f"s{priority}"

        @staticmethod
        def priority_range() -> tuple[int, int]:
            return 0, -5

        def wait_event(self, ev) -> None:
            log.append(("wait", self.name, ev.name))

    class Event:
        n = 0

        def __init__(self) -> None:
            self.name, Event.n = f"e{Event.n}", Event.n + 1

        def record(self, stream) -> None:
            log.append(("record", self.name, stream.name))

    class Cur:
        name = "cur"

        def wait_event(self, ev) -> None:
            log.append(("wait", "cur", ev.name))

    current: list[str] = ["cur"]

    class StreamContext:
        def __init__(self, st) -> None:
            self.st = st

        def __enter__(self) -> None:
            current.append(self.st.name)

        def __exit__(self, *exc) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Cur())
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    codec, cache, q = _setup(seed=35, lengths=[120, 64, 90])
    one = TritonReader(codec, ReadPolicy.flexible(2.0))
    want, _ = one.decode(q, cache, 0, plan=one.plan(3, 128, "cpu"))
    reader = TritonReader(codec, ReadPolicy.flexible(2.0), config=ReaderConfig(batch_streams=3))
    plan = reader.plan(3, 128, "cpu")
    plan.device = torch.device("cuda")  # only _with_parts and _run_parts look: the parts run on the CPU
    plan = reader._with_parts(dataclasses.replace(plan, parts=()))
    for part in plan.parts:
        part.device = torch.device("cpu")
    assert [s.priority for s in plan.streams] == [-2, -1, 0]
    run = reader.run

    def spy(pl, *args, **kw):
        if pl.parts == () and pl is not plan:
            log.append(("run", current[-1], pl.batch))
        return run(pl, *args, **kw)

    monkeypatch.setattr(reader, "run", spy)
    plan.out.fill_(float("nan"))
    pt = cache.page_table.to(torch.int32)
    out = reader._run_parts(plan, q, cache.k_pool[0], cache.v_pool[0], pt, cache.lengths[0].to(torch.int32), 0, None)
    assert out is None and torch.equal(plan.out, want)
    assert log == [("record", "e0", "cur"),
                   ("wait", "s-2", "e0"), ("run", "s-2", 1), ("record", "e1", "s-2"),
                   ("wait", "s-1", "e0"), ("run", "s-1", 1), ("record", "e2", "s-1"),
                   ("wait", "s0", "e0"), ("run", "s0", 1), ("record", "e3", "s0"),
                   ("wait", "cur", "e1"), ("wait", "cur", "e2"), ("wait", "cur", "e3")]
    flat = TritonReader(codec, ReadPolicy.flexible(2.0), config=ReaderConfig(batch_streams=3, stream_priority=False))
    assert [s.priority for s in flat._with_parts(dataclasses.replace(plan, parts=())).streams] == [0, 0, 0]


def test_plans_of_one_reader_keep_their_own_program_sizes() -> None:
    """A plan runs with its own pages per program and block size even after the same reader planned
    another step shape (a B=1 plan's 256-token blocks beside a B=32 plan's 1024, say)."""
    codec, cache, q = _setup(seed=36, lengths=[150, 97])
    page = cache.spec.page_size
    fresh = TritonReader(codec, ReadPolicy.flexible(2.0))
    want, _ = fresh.decode(q, cache, 0, plan=fresh.plan(2, 150, "cpu", pages_per_program=1, block_tokens=page))
    reader = TritonReader(codec, ReadPolicy.flexible(2.0))
    first = reader.plan(2, 150, "cpu", pages_per_program=1, block_tokens=page)
    reader.plan(2, 150, "cpu", pages_per_program=2, block_tokens=2 * page)
    first.out.fill_(float("nan"))
    got, _ = reader.decode(q, cache, 0, plan=first)
    assert torch.equal(got, want)
