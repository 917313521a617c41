"""The two-pass Value allocation (planekv.kernels.alloc2) finds the radix select's lambda: the same
Value depths as the 8-pass radix select and as the reference reader, also when a group's bracket
overflows its candidate buffer and the radix passes run for that group alone."""

from __future__ import annotations

import pytest
import torch

from planekv.kernels import TritonReader
from planekv.kvstore import ReadPolicy
from planekv.kvstore.reference import readkv_decode

from .test_reader import POLICIES, _setup, assert_same_depths


@pytest.mark.parametrize("name", ["flexible-r2-k0.3", "constrained-r2", "explicit-budgets", "flexible-r2-head-weight"])
@pytest.mark.parametrize("cap", [None, 2])
def test_two_pass_equals_radix_select(name: str, cap: int | None) -> None:
    """cap=2: groups whose candidates overflow get lambda from the gated radix passes."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=len(name) + (cap or 0), lengths=lengths)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    runs = {}
    for alloc in ("radix", "two-pass"):
        reader = TritonReader(codec, policy, value_alloc=alloc, cand_cap=cap if alloc == "two-pass" else None)
        reader.hist_sample = 0  # every token's importance counted (the sampled bracket: below)
        plan = reader.plan(2, 150, "cpu", block_tokens=64)  # several blocks per sequence
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[alloc] = (out, st, plan)
    (o_r, s_r, _), (o_t, s_t, p_t) = runs["radix"], runs["two-pass"]
    overflowed = p_t.cmeta[:, 4].bool()
    if cap is None:
        assert not bool(overflowed.any())
    elif policy.pool_heads:  # a pooled group's bracket holds more than 2 keys: it falls back
        assert bool(overflowed.any())
    assert torch.equal(s_t.v_depths, s_r.v_depths)
    assert torch.equal(o_t, o_r)
    for b in range(2):
        assert_same_depths(s_t.v_depths[b, :, : lengths[b]], rst.extra["v_depths"][b], policy.v_packet)
    assert ((o_t - ref).norm() / ref.norm()).item() < 1e-3


def test_gated_passes_striding_over_blocks_equal_one_program_per_block() -> None:
    """A gated radix pass runs ``gated_splits`` programs per (sequence, KV head), each striding over the
    blocks: with one program for all five blocks the fallen-back groups get the same depths and output
    as with a program per block, and as the radix select."""
    policy = POLICIES["flexible-r2-k0.3"]
    lengths = [300, 170]
    codec, cache, q = _setup(seed=11, lengths=lengths)
    runs = {}
    for splits in (1, 8):
        reader = TritonReader(codec, policy, value_alloc="two-pass", cand_cap=2)
        reader.hist_sample = 0
        reader.gated_splits = splits
        plan = reader.plan(2, 300, "cpu", block_tokens=64)  # 5 blocks in the longer sequence
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        assert bool(plan.cmeta[:, 4].bool().any())  # some group fell back to the gated passes
        runs[splits] = (out, st)
    radix = TritonReader(codec, policy, value_alloc="radix")
    plan = radix.plan(2, 300, "cpu", block_tokens=64)
    o_r, s_r = radix.decode(q, cache, 0, plan=plan)
    for out, st in runs.values():
        assert torch.equal(st.v_depths, s_r.v_depths)
        assert torch.equal(out, o_r)
    reader.gated_splits = 0  # no program would run the passes
    with pytest.raises(ValueError, match="gated_splits"):
        reader.decode(q, cache, 0, plan=reader.plan(2, 300, "cpu", block_tokens=64))


def test_two_pass_bracket_holds_lambda_with_few_candidates() -> None:
    """On a longer sequence the bracket from the importance histogram holds a small share of the
    keys and lambda lies inside it."""
    codec, cache, q = _setup(seed=9, lengths=[1000])
    policy = ReadPolicy.flexible(2.0, 0.875)
    reader = TritonReader(codec, policy, value_alloc="two-pass")
    reader.hist_sample = 0
    plan = reader.plan(1, 1000, "cpu")
    reader.decode(q, cache, 0, plan=plan)
    lo, hi, n_cand, n_above, over, ranked = plan.cmeta[0, :6].tolist()
    lam = int(plan.hist[0, 128 + 2 * 7])  # where the radix select leaves lambda (SELBASE + 2 (NPASS - 1))
    lam += 1 - ranked  # where every key at lambda is taken, lambda - 1 is stored (none left to take)
    n_keys = reader.ks_v * cache.spec.n_kv_heads * 1000
    assert over == 0 and lo < lam <= hi
    assert 0 < n_cand < 0.1 * n_keys and n_above >= 0


def test_value_alloc_is_checked_and_chosen_by_step_size() -> None:
    codec, _, _ = _setup(seed=1, lengths=[64])
    auto = TritonReader(codec, ReadPolicy.flexible(2.0))
    assert not auto.plan(1, 4096, "cpu").two_pass and auto.plan(256, 8192, "cpu").two_pass  # from 2^19 triples
    assert TritonReader(codec, ReadPolicy.flexible(2.0), value_alloc="two-pass").plan(1, 64, "cpu").two_pass
    # the per-block allocation kernels: 8 warps, 4 from 2^22 triples; _prep's radix passes for small groups
    assert auto._alloc_warps(32 * 8 * 32768) == 4 and auto._alloc_warps(8 * 8192) == 8
    assert TritonReader(codec, ReadPolicy.flexible(2.0), alloc_warps=8)._alloc_warps(1 << 24) == 8
    assert auto._prep_radix()  # 2 KV heads x d=64 x 8 steps: 1024 keys per group
    big = _setup(seed=1, lengths=[64], hq=16, hk=8, d=128)[0]
    assert not TritonReader(big, ReadPolicy.flexible(2.0))._prep_radix()  # 8 heads x 128 x 8: 8192 keys
    assert TritonReader(big, ReadPolicy.constrained(2.0))._prep_radix()  # one head per group: 1024 keys
    with pytest.raises(ValueError, match="alloc_warps"):
        TritonReader(codec, ReadPolicy.flexible(2.0), alloc_warps=3)
    with pytest.raises(ValueError, match="value_alloc"):
        TritonReader(codec, ReadPolicy.flexible(2.0), value_alloc="sort")
    with pytest.raises(ValueError, match="cand_cap"):
        TritonReader(codec, ReadPolicy.flexible(2.0), cand_cap=100)
    # the bracket from 1 in 16 tokens by default, and a candidate buffer to match
    assert auto._hist_sample() == 16 and auto._cap(1 << 20) == 65536
    bad = TritonReader(codec, ReadPolicy.flexible(2.0))
    bad.hist_sample = 3
    with pytest.raises(ValueError, match="hist_sample"):
        bad.plan(1, 64, "cpu")
    bins = TritonReader(codec, ReadPolicy.flexible(2.0), value_alloc="two-pass")
    bins.exact_bins = 100
    with pytest.raises(ValueError, match="exact_bins"):
        bins.plan(1, 64, "cpu")


@pytest.mark.parametrize("name,alloc,cap", [("constrained-r2", "radix", None), ("flexible-r2-k0.3", "two-pass", 2)])
def test_selection_by_the_last_program_equals_separate_launches(name: str, alloc: str, cap: int | None) -> None:
    """Each radix pass's selection run by the group's last program to finish (``fused_select``, the
    default) gives the launches' lambda, depths and output, bit for bit, over several blocks and
    groups, and again on a second step with the same plan (the arrival counters restart at zero)."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=31 + len(name), lengths=lengths)
    got = {}
    for fused in (False, True):
        reader = TritonReader(codec, policy, value_alloc=alloc, cand_cap=cap)
        reader.fused_select = fused
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        steps = []
        for _ in range(2):
            plan.out.fill_(float("nan"))
            out, st = reader.decode(q, cache, 0, plan=plan)
            steps.append((out.clone(), st.v_depths.clone(), plan.hist[:, 128:144].clone()))
        got[fused] = steps
    if alloc == "two-pass":  # the gated radix passes ran for the overflowing groups
        assert bool(plan.cmeta[:, 4].bool().any())
    for step in range(2):
        (o0, d0, s0), (o1, d1, s1) = got[False][step], got[True][step]
        assert torch.equal(s1, s0)  # every pass's digits and remaining count
        assert torch.equal(d1, d0)
        assert torch.equal(o1, o0)
    assert torch.equal(got[True][1][0], got[True][0][0])


def test_windowed_importance_histogram_counts_every_token_once() -> None:
    """``hist_window``: the block-local counts of a window of bins plus the single adds of the tokens
    outside it give the per-token histogram exactly (the same bracket, depths and output)."""
    codec, cache, q = _setup(seed=5, lengths=[700, 333])
    policy = ReadPolicy.flexible(2.0, 0.875)
    got = []
    for win in (0, 16):  # 16 bins: most tokens of a block fall outside, both paths run
        reader = TritonReader(codec, policy, value_alloc="two-pass")
        reader.hist_window, reader.hist_sample = win, 0
        plan = reader.plan(2, 700, "cpu", block_tokens=128)
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        got.append((plan.ihist.clone(), st.v_depths.clone(), out.clone()))
    (h0, d0, o0), (h1, d1, o1) = got
    hk = cache.spec.n_kv_heads
    per_head = h0.view(2, hk + 1, -1)[:, :hk]  # each head's histogram, then the heads' suffix sums
    assert int(per_head.sum()) == hk * (700 + 333) and torch.equal(h1, h0)
    assert torch.equal(d1, d0) and torch.equal(o1, o0)


@pytest.mark.parametrize("name", ["constrained-r2", "flexible-r2-k0.3"])
def test_radix_histogram_variants_agree(name: str) -> None:
    """``radix_hist``: one histogram of 2 x NBINS bins over every step's keys (the masked keys in
    the upper half, never added) and one histogram per step give the same radix histograms, digits
    and output, over several 256-token blocks with padding steps (the constrained reader's 3 steps
    in 4 rows)."""
    codec, cache, q = _setup(seed=12, lengths=[700, 300])
    got = []
    for rh in (0, 1):
        reader = TritonReader(codec, POLICIES[name], value_alloc="radix")
        reader.radix_hist = rh
        plan = reader.plan(2, 700, "cpu", block_tokens=256)
        out, _ = reader.decode(q, cache, 0, plan=plan)
        got.append((plan.hist[:, :144].clone(), out.clone()))
    assert int(got[0][0][:, :16].sum()) > 0  # pass 1 counted keys
    assert torch.equal(got[1][0], got[0][0]) and torch.equal(got[1][1], got[0][1])


@pytest.mark.parametrize("gate", [0, 1])
def test_tie_counts_only_where_keys_at_lambda_need_ranks(gate: int) -> None:
    """``_v_exact`` stores lambda - 1 with none left to take where every key at lambda is taken (the
    same depths), and ``tie_gate`` then skips the tie counts of those groups: their tie buffer is left
    as it was (poisoned here) and the depths and output equal the ungated run's and the reference's.
    With peaked queries many importances are exactly 0 and a budget past the positive gains puts
    lambda on those ties: that group still counts and ranks them."""
    codec, cache, q = _setup(seed=23, lengths=[150, 97])
    for policy, peaked in ((ReadPolicy.flexible(2.0, 0.875), False),
                           (ReadPolicy(rate=None, budget_k=256, budget_v=101, pool_heads=True), True)):
        qq = q * 300.0 if peaked else q
        ref, rst = readkv_decode(qq, cache, 0, codec, policy)
        reader = TritonReader(codec, policy, value_alloc="two-pass")
        reader.tie_gate, reader.hist_sample = gate, 0  # (a sampled bracket may miss: its group then ranks)
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        plan.ties.fill_(-7)
        out, st = reader.decode(qq, cache, 0, plan=plan)
        ranked = plan.cmeta[:, 5].bool()
        assert bool(ranked.any()) == peaked  # lambda on many equal keys, only some of them taken
        skipped = (plan.ties.view(plan.ties.shape[0], -1) == -7).all(1)
        assert torch.equal(skipped, ~ranked if gate else torch.zeros_like(ranked))
        for b, t in enumerate([150, 97]):
            assert_same_depths(st.v_depths[b, :, :t], rst.extra["v_depths"][b], policy.v_packet)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("name", ["flexible-r2-k0.3", "constrained-r2", "explicit-budgets", "full-key-budget"])
def test_key_lambda_by_radix_passes_equals_the_bisection(name: str) -> None:
    """``prep_radix``: the Key allocation's lambda from 8 radix passes in ``_prep`` gives the 32-step
    bisection's channel depths, channel lists and output, for pooled and per-head groups, with the
    query heads of one KV head zeroed (its channels' importances, and so its keys, all 0: lambda on
    those ties, taken in part), and with a budget that takes every key."""
    policy = (ReadPolicy(rate=None, budget_k=10_000, budget_v=100, pool_heads=True) if name == "full-key-budget"
              else POLICIES[name])
    codec, cache, q = _setup(seed=41 + len(name), lengths=[150, 97])
    q = q.clone()
    q[0, :2] = 0.0  # sequence 0, KV head 0 (query heads 0, 1): every key of its channels is 0
    got = []
    for radix in (0, 1):
        reader = TritonReader(codec, policy)
        reader.prep_radix = radix
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        got.append((st.k_depths.clone(), plan.kcnt.clone(), out.clone()))
    assert torch.equal(got[1][0], got[0][0]) and torch.equal(got[1][1], got[0][1])
    assert torch.equal(got[1][2], got[0][2])
    assert int(got[0][0].sum()) > 0


@pytest.mark.parametrize("name,slack", [("flexible-r2-k0.3", 0.05), ("constrained-r2", 0.05),
                                        ("explicit-budgets", -1.0), ("flexible-r2-head-weight", -1.0)])
def test_sampled_bracket_equals_radix_select(name: str, slack: float) -> None:
    """``hist_sample``: the bracket from 1 in 8 tokens' importances and the importances computed by
    the candidates pass give the radix select's depths and output bit for bit. slack -1 (and no
    standard deviations) shrinks the bracket to (almost) nothing, so it misses lambda: those groups
    fall back to the radix passes (flagged) and still find it."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=40 + len(name), lengths=lengths)
    runs = {}
    for sample in (0, 16):  # 16, capped at one in 8 of a 64-token block
        reader = TritonReader(codec, policy, value_alloc="radix" if not sample else "two-pass")
        reader.hist_sample, reader.sample_slack = sample, slack
        reader.sample_z = 3.0 if slack > 0 else 0.0
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        plan.out.fill_(float("nan"))
        plan.vimp.fill_(float("nan"))  # the candidates pass must write every importance
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[sample] = (out, st, plan)
    (o_r, s_r, p_r), (o_s, s_s, p_s) = runs[0], runs[16]
    if slack < 0:
        assert bool(p_s.cmeta[:, 4].bool().any())
    for b in range(2):  # the importances, as the histogram pass writes them
        assert torch.equal(p_s.vimp[b, :, : lengths[b]], p_r.vimp[b, :, : lengths[b]])
    assert torch.equal(s_s.v_depths, s_r.v_depths)
    assert torch.equal(o_s, o_r)


def test_sampled_bracket_holds_lambda_on_a_long_sequence() -> None:
    """1 in 16 tokens of a 4096-token sequence: the widened bracket holds lambda (no fall back), with
    a small share of the keys as candidates."""
    n = 4096
    codec, cache, q = _setup(seed=9, lengths=[n])
    policy = ReadPolicy.flexible(2.0, 0.875)
    reader = TritonReader(codec, policy, value_alloc="two-pass")
    reader.hist_sample = 16
    plan = reader.plan(1, n, "cpu", block_tokens=1024)
    out, st = reader.decode(q, cache, 0, plan=plan)
    lo, hi, n_cand, n_above, over, ranked = plan.cmeta[0, :6].tolist()
    n_keys = reader.ks_v * cache.spec.n_kv_heads * n
    assert over == 0 and 0 < n_cand < 0.15 * n_keys
    ref = TritonReader(codec, policy, value_alloc="radix")
    out_r, st_r = ref.decode(q, cache, 0, plan=ref.plan(1, n, "cpu", block_tokens=1024))
    assert torch.equal(st.v_depths, st_r.v_depths) and torch.equal(out, out_r)


@pytest.mark.parametrize("name,sample", [("flexible-r2-k0.3", 0), ("constrained-r2", 16)])
def test_binned_exact_pass_equals_the_bisection(name: str, sample: int) -> None:
    """``exact_bins``: lambda's bin from the candidates' histogram, then a bisection among that bin's
    candidates only, gives the same lambda, keys left to take, depths and output as the bisection over
    every candidate: with 16 bins (wide bins, several candidates each) and 4096 (narrow ones)."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=50 + len(name), lengths=lengths)
    got = {}
    for bins in (0, 16, 4096):
        reader = TritonReader(codec, policy, value_alloc="two-pass")
        reader.hist_sample, reader.exact_bins = sample, bins
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        got[bins] = (out, st.v_depths, plan.hist[:, 128:144].clone(), plan.cmeta.clone(), plan.cbins.clone())
    o0, d0, l0, m0, _ = got[0]
    for bins in (16, 4096):
        o1, d1, l1, m1, cb = got[bins]
        assert torch.equal(m1[:, :6], m0[:, :6])  # the same bracket, candidates, fall backs, ranks
        held = m1[:, 4] == 0
        assert bool(held.any())
        assert torch.equal(l1[held], l0[held])  # lambda and the keys at it left to take
        assert torch.equal(cb.sum(1)[held], m1[held, 2])  # every candidate counted once
        assert torch.equal(d1, d0) and torch.equal(o1, o0)


@pytest.mark.parametrize("name,keep", [("flexible-r2-k0.3", 4096), ("constrained-r2", 2)])
def test_split_exact_pass_equals_the_one_program_pass(name: str, keep: int) -> None:
    """``exact_split``: the scan for lambda's bin over programs of 64 candidates each (several per group),
    the last to arrive bisecting among the kept keys, gives the one-program pass's lambda, keys left to
    take, depths and output; keep=2 (fewer slots than the bin's keys) takes the bisection over every
    candidate in the bin's range instead."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=60 + len(name), lengths=lengths)
    got = {}
    for split in (0, 64):
        reader = TritonReader(codec, policy, value_alloc="two-pass")
        reader.exact_split, reader._exact_keep, reader.exact_bins = split, keep, 16
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        assert split == 0 or plan.cand.shape[1] // split > 1  # several programs per group
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        got[split] = (out, st.v_depths, plan.hist[:, 128:144].clone(), plan.cmeta.clone())
    (o0, d0, l0, m0), (o1, d1, l1, m1) = got[0], got[64]
    held = m1[:, 4] == 0
    assert bool(held.any()) and torch.equal(m1[:, :7], m0[:, :7])
    assert torch.equal(m1[held, 8], torch.full_like(m1[held, 8], plan.cand.shape[1] // 64))  # every program arrived
    if keep == 2:
        assert bool((m1[held, 7] > keep).any())  # some bin held more keys than the list
    assert torch.equal(l1[held], l0[held])
    assert torch.equal(d1, d0) and torch.equal(o1, o0)
    auto = TritonReader(codec, policy, value_alloc="two-pass")  # split where groups x programs <= 4 per SM
    assert auto._exact_chunk(32768, 32, "cpu") == 4096 and auto._exact_chunk(32768, 256, "cpu") == 0
    bad = TritonReader(codec, policy, value_alloc="two-pass")
    bad.exact_split = 48
    with pytest.raises(ValueError, match="exact_split"):
        bad.plan(2, 150, "cpu")
