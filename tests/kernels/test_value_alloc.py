"""The Value allocation (planekv.kernels.value_alloc, value_alloc_two_pass): the two-pass allocation finds the
radix selection's lambda, so the same Value depths as the 8-pass radix selection and as the reference reader,
also when a group's bracket overflows its candidate buffer or misses lambda and the radix passes run for that
group alone; ties at lambda are ranked only where some are left; a plan repeats its results step after step."""

from __future__ import annotations

import pytest
import torch

from planekv.kernels import ReaderConfig, TritonReader
from planekv.kvstore import ReadPolicy
from planekv.kvstore.reference import readkv_decode

from .test_reader import POLICIES, _setup, assert_same_depths


@pytest.mark.parametrize("name", ["flexible-r2-k0.3", "constrained-r2", "explicit-budgets", "flexible-r2-head-weight"])
@pytest.mark.parametrize("cap", [pytest.param(None, marks=pytest.mark.slow), 2])  # None: uncapped, the slowest
def test_two_pass_equals_radix_select(name: str, cap: int | None) -> None:
    """cap=2: groups whose candidates overflow get lambda from the gated radix passes."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=len(name) + (cap or 0), lengths=lengths)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    runs = {}
    for alloc in ("radix", "two-pass"):
        cfg = ReaderConfig(value_alloc=alloc, cand_cap=cap if alloc == "two-pass" and cap else "auto")
        reader = TritonReader(codec, policy, config=cfg)
        plan = reader.plan(2, 150, "cpu", block_tokens=64)  # several blocks per sequence
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[alloc] = (out, st, plan)
    (o_r, s_r, _), (o_t, s_t, p_t) = runs["radix"], runs["two-pass"]
    overflowed = p_t.cmeta[:, 4].bool()
    if cap is None:
        assert not bool(overflowed.any())
        # every candidate counted once in the candidates' bins (the exact pass bisects in lambda's bin)
        assert torch.equal(p_t.cbins.sum(1), p_t.cmeta[:, 2])
    elif policy.pool_heads:  # a pooled group's bracket holds more than 2 keys: it falls back
        assert bool(overflowed.any())
    assert torch.equal(s_t.v_depths, s_r.v_depths)
    assert torch.equal(o_t, o_r)
    for b in range(2):
        assert_same_depths(s_t.v_depths[b, :, : lengths[b]], rst.extra["v_depths"][b], policy.v_packet)
    assert ((o_t - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.slow  # about 25 s in the interpreter
def test_gated_passes_striding_over_blocks_equal_one_program_per_block() -> None:
    """A gated radix pass runs ``gated_splits`` programs per (sequence, KV head), each striding over the
    blocks: with one program for all five blocks the fallen-back groups get the same depths and output
    as with a program per block, and as the radix select."""
    policy = POLICIES["flexible-r2-k0.3"]
    lengths = [300, 170]
    codec, cache, q = _setup(seed=11, lengths=lengths)
    runs = {}
    for splits in (1, 8):
        reader = TritonReader(codec, policy, config=ReaderConfig(value_alloc="two-pass", cand_cap=2,
                                                                 gated_splits=splits))
        plan = reader.plan(2, 300, "cpu", block_tokens=64)  # 5 blocks in the longer sequence
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        assert bool(plan.cmeta[:, 4].bool().any())  # some group fell back to the gated passes
        runs[splits] = (out, st)
    radix = TritonReader(codec, policy, config=ReaderConfig(value_alloc="radix"))
    plan = radix.plan(2, 300, "cpu", block_tokens=64)
    o_r, s_r = radix.decode(q, cache, 0, plan=plan)
    for out, st in runs.values():
        assert torch.equal(st.v_depths, s_r.v_depths)
        assert torch.equal(out, o_r)
    with pytest.raises(ValueError, match="gated_splits"):  # no program would run the passes
        ReaderConfig(gated_splits=0)


@pytest.mark.parametrize("name,alloc,cap", [("constrained-r2", "radix", None), ("flexible-r2-k0.3", "two-pass", 2)])
def test_a_second_step_on_one_plan_repeats_the_first(name: str, alloc: str, cap: int | None) -> None:
    """Each radix pass's selection is run by the group's last program to arrive, counted in the plan's
    histogram words: a second step with the same plan must start those counters at zero again and give the
    first step's digits, depths and output bit for bit (over several blocks and groups, with the gated passes
    of overflowing groups in the two-pass case); both equal the reference reader's depths."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=31 + len(name), lengths=lengths)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    reader = TritonReader(codec, policy, config=ReaderConfig(value_alloc=alloc, cand_cap=cap or "auto"))
    plan = reader.plan(2, 150, "cpu", block_tokens=64)
    steps = []
    for _ in range(2):
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        steps.append((out.clone(), st.v_depths.clone(), plan.hist[:, 128:144].clone()))
    if alloc == "two-pass":  # the gated radix passes ran for the overflowing groups
        assert bool(plan.cmeta[:, 4].bool().any())
    (o0, d0, s0), (o1, d1, s1) = steps
    assert torch.equal(s1, s0)  # every pass's digits and remaining count
    assert torch.equal(d1, d0) and torch.equal(o1, o0)
    for b in range(2):
        assert_same_depths(d1[b, :, : lengths[b]], rst.extra["v_depths"][b], policy.v_packet)


def test_tie_counts_only_where_keys_at_lambda_need_ranks() -> None:
    """``_v_exact`` stores lambda - 1 with none left to take where every key at lambda is taken (the
    same depths), and the tie counts then skip those groups: their tie buffer is left as it was
    (poisoned here) and the depths and output equal the reference's.
    With peaked queries many importances are exactly 0 and a budget past the positive gains puts
    lambda on those ties: that group still counts and ranks them."""
    codec, cache, q = _setup(seed=23, lengths=[150, 97])
    for policy, peaked in ((ReadPolicy.flexible(2.0, 0.875), False),
                           (ReadPolicy(rate=None, budget_k=256, budget_v=101, pool_heads=True), True)):
        qq = q * 300.0 if peaked else q
        ref, rst = readkv_decode(qq, cache, 0, codec, policy)
        # a wide bracket, so that it holds lambda here (a group whose sampled bracket misses ranks its ties)
        cfg = ReaderConfig(value_alloc="two-pass", sample_slack=0.5, sample_z=4.0)
        reader = TritonReader(codec, policy, config=cfg)
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        plan.ties.fill_(-7)
        out, st = reader.decode(qq, cache, 0, plan=plan)
        ranked = plan.cmeta[:, 5].bool()
        assert bool(ranked.any()) == peaked  # lambda on many equal keys, only some of them taken
        skipped = (plan.ties.view(plan.ties.shape[0], -1) == -7).all(1)
        assert torch.equal(skipped, ~ranked)
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
    for radix in (False, True):
        reader = TritonReader(codec, policy, config=ReaderConfig(prep_radix=radix))
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
    """The bracket from 1 in 8 tokens' importances (16, capped at one run of 8 per 64-token block) and the
    importances computed by the candidates pass give the radix selection's depths and output bit for bit.
    slack -1 (and no
    standard deviations) shrinks the bracket to (almost) nothing, so it misses lambda: those groups
    fall back to the radix passes (flagged) and still find it."""
    policy = POLICIES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=40 + len(name), lengths=lengths)
    runs = {}
    for alloc in ("radix", "two-pass"):
        cfg = ReaderConfig(value_alloc=alloc, sample_slack=slack, sample_z=3.0 if slack > 0 else 0.0)
        reader = TritonReader(codec, policy, config=cfg)
        plan = reader.plan(2, 150, "cpu", block_tokens=64)
        plan.out.fill_(float("nan"))
        plan.vimp.fill_(float("nan"))  # the candidates pass must write every importance
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[alloc] = (out, st, plan)
    (o_r, s_r, p_r), (o_s, s_s, p_s) = runs["radix"], runs["two-pass"]
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
    reader = TritonReader(codec, policy, config=ReaderConfig(value_alloc="two-pass"))
    plan = reader.plan(1, n, "cpu", block_tokens=1024)
    assert plan.choices.sample == 16
    out, st = reader.decode(q, cache, 0, plan=plan)
    lo, hi, n_cand, n_above, over, ranked = plan.cmeta[0, :6].tolist()
    n_keys = reader.consts.ks_v * cache.spec.n_kv_heads * n
    assert over == 0 and 0 < n_cand < 0.15 * n_keys
    ref = TritonReader(codec, policy, config=ReaderConfig(value_alloc="radix"))
    out_r, st_r = ref.decode(q, cache, 0, plan=ref.plan(1, n, "cpu", block_tokens=1024))
    assert torch.equal(st.v_depths, st_r.v_depths) and torch.equal(out, out_r)


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
        reader = TritonReader(codec, policy, config=ReaderConfig(value_alloc="two-pass", exact_split=split,
                                                                 exact_keep=keep))
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
    with pytest.raises(ValueError, match="exact_split"):
        ReaderConfig(exact_split=48)
