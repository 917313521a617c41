"""The torch reference two-stage reader (DESIGN 1.5-1.8): exact logical-read accounting, full depth equals
float attention over the 8-bit reconstruction, GQA importance per physical KV head, MQA, teacher-forced
rows equal decode steps, batched decode equals per-sequence decode, the constrained reader's ladder,
and format identity on read."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
import torch

from planekv.kvstore import (
    BudgetError,
    Codec,
    FormatMismatch,
    FormatSpec,
    PlaneKVCache,
    ReadPolicy,
    threshold_allocate,
)
from planekv.kvstore.reference import attention, readkv_decode, readkv_rows, readkv_teacher_forced

D_HEAD = 64


def _setup(synthetic, n_tokens=200, n_rows=3, n_q_heads=8, n_kv_heads=2):
    """(codec, q [Hq, M, d], k, v [Hkv, T, d], K codes, V codes). The synthetic queries are scaled by
    the spread of their logits, so draw at least 16 tokens and keep the first n_tokens."""
    syn, codec = synthetic(n_tokens=max(n_tokens, 16), n_rows=n_rows, n_layers=1, n_q_heads=n_q_heads,
                           n_kv_heads=n_kv_heads, head_dim=D_HEAD)
    q, k, v = syn.q[0], syn.k[0][:, :n_tokens], syn.v[0][:, :n_tokens]
    return codec, q, k, v, codec.encode_k(k, 0), codec.encode_v(v, 0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n_tokens", [1, 37, 200])
@pytest.mark.parametrize("rate", [0.25, 1.0, 2.0, 3.3, 4.0, 5.5, 8.0])
@pytest.mark.parametrize("k_share", [0.3, 0.5, 0.7])
def test_flexible_bits_are_exactly_the_budget(synthetic, n_tokens, rate, k_share):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n_tokens)
    pol = ReadPolicy.flexible(rate, k_share)
    bk, bv = pol.budgets(n_tokens, D_HEAD)
    out, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.full((3,), n_tokens))
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    assert st.k_bits.tolist() == [float(n_tokens * bk * 2)] * 3
    assert st.v_bits.tolist() == [float(D_HEAD * bv * 2)] * 3
    assert st.tokens.tolist() == [float(n_tokens)] * 3
    assert st.k_depths.shape == (3, 2, D_HEAD) and st.v_depths.shape == (3, 2, n_tokens)
    assert int(st.k_depths.max()) <= 8 and int(st.v_depths.max()) <= 8
    # pooled across heads: the layer's total is n_kv_heads x the per-head budget
    assert st.k_depths.sum((1, 2)).tolist() == [2 * bk] * 3
    assert st.bits_per_scalar == pytest.approx((n_tokens * bk + D_HEAD * bv) / (2 * n_tokens * D_HEAD))


@pytest.mark.parametrize("budget_k,budget_v", [(0, 0), (1, 1), (37, 123), (300, 17), (512, 1600)])
def test_explicit_budgets(synthetic, budget_k, budget_v):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=200)
    pol = ReadPolicy(rate=None, budget_k=budget_k, budget_v=budget_v)
    _, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.full((3,), 200))
    assert st.k_bits.tolist() == [200.0 * budget_k * 2] * 3
    assert st.v_bits.tolist() == [64.0 * budget_v * 2] * 3


def test_per_head_budgets_when_not_pooled(synthetic):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=150)
    pol = ReadPolicy(rate=3.0, pool_heads=False)
    bk, bv = pol.budgets(150, D_HEAD)
    _, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.full((3,), 150))
    assert st.k_depths.sum(2).tolist() == [[bk, bk]] * 3
    assert st.v_depths.sum(2).tolist() == [[bv, bv]] * 3
    _, pooled = readkv_rows(q, kc, vc, codec, 0, ReadPolicy(rate=3.0), torch.full((3,), 150))
    # pooling moves planes between the heads (the synthetic heads differ), the total is the same
    assert pooled.k_depths.sum((1, 2)).tolist() == [2 * bk] * 3
    assert not torch.equal(pooled.k_depths.sum(2), st.k_depths.sum(2))


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(8.0), ReadPolicy(rate=None, budget_k=64 * 8, budget_v=120 * 8),
                                    ReadPolicy(rate=8.0, pool_heads=False)])
def test_full_depth_equals_attention_over_8bit_reconstruction(synthetic, policy):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=120)
    lengths = torch.full((3,), 120)
    out, st = readkv_rows(q, kc, vc, codec, 0, policy, lengths)
    assert bool((st.k_depths == 8).all()) and bool((st.v_depths == 8).all())
    kd, vd = codec.decode(kc, 8, 0, "k"), codec.decode(vc, 8, 0, "v")
    want = attention(q, kd, vd, lengths)
    # float32 rounding of two summation orders: 1e-5 of the output's scale
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())))


def test_rate_zero_reads_only_the_means(synthetic):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=50)
    out, st = readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(0.0), torch.full((3,), 50))
    assert float(st.total_bits.sum()) == 0.0
    # every key reconstructs to mu_K: uniform attention over values that all reconstruct to mu_V
    mu_v, _ = codec.stats(0, "v")
    want = codec.rot_v.inverse(mu_v).repeat_interleave(4, 0)[:, None, :].expand_as(out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_error_falls_with_rate(synthetic):
    codec, q, k, v, kc, vc = _setup(synthetic, n_tokens=256, n_rows=4)
    lengths = torch.full((4,), 256)
    dense = attention(q, k, v, lengths)
    errs = [_rel(readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(r), lengths)[0], dense)
            for r in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in pairwise(errs)), errs
    assert errs[-1] < 0.05


def test_gqa_bits_are_per_physical_kv_head(synthetic):
    for hq in (2, 4, 8):
        codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=100, n_q_heads=hq)
        pol = ReadPolicy.flexible(2.0)
        bk, bv = pol.budgets(100, D_HEAD)
        _, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.full((3,), 100))
        assert st.k_bits.tolist() == [100.0 * bk * 2] * 3  # not G times
        assert st.v_bits.tolist() == [64.0 * bv * 2] * 3
        assert st.k_depths.shape == (3, 2, D_HEAD) and st.v_depths.shape == (3, 2, 100)


def test_gqa_importance_is_summed_over_the_group(synthetic):
    """Query head h reads KV head h // G; a duplicated query head counts as double importance."""
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=90, n_q_heads=4, n_kv_heads=2)
    pol = ReadPolicy.flexible(1.5)
    lengths = torch.full((3,), 90)
    qd = q.clone()
    qd[1] = qd[0]  # group 0 = {q0, q0}; group 1 = {q2, q3}
    _, st = readkv_rows(qd, kc, vc, codec, 0, pol, lengths)
    _, sig_k = codec.stats(0, "k")
    x = codec.rot_k.forward(qd.float()) * sig_k.repeat_interleave(2, 0)[:, None, :]  # [Hq, M, d]
    a = torch.stack([2 * (x[0] * x[0]), x[2] * x[2] + x[3] * x[3]], 1)  # [M, Hkv, d]
    bk, _ = pol.budgets(90, D_HEAD)
    want = threshold_allocate(a.reshape(3, -1), bk * 2, codec.tree.distortion).reshape(3, 2, D_HEAD)
    assert torch.equal(st.k_depths, want)
    # with q1 silenced instead, group 0 weighs half as much: the depths move
    qz = qd.clone()
    qz[1] = 0
    _, st0 = readkv_rows(qz, kc, vc, codec, 0, pol, lengths)
    assert st0.k_depths[:, 0].sum() < st.k_depths[:, 0].sum()


def test_value_importance_is_sum_of_squared_probabilities(synthetic):
    """b_i = sum_{h in group} p_{h,i}^2 with p the softmax over K reconstructed at the Key depths."""
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=120, n_rows=2, n_q_heads=4, n_kv_heads=2)
    pol = ReadPolicy.flexible(2.0)
    _, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.full((2,), 120))
    _, bv = pol.budgets(120, D_HEAD)
    qt = codec.rot_k.forward(q.double())  # [Hq, M, d]
    mismatches = 0
    for m in range(2):
        kt = codec.reconstruct(kc, st.k_depths[m][:, None, :], 0, "k").double()  # [Hkv, T, d]
        logits = torch.einsum("hd,htd->ht", qt[:, m], kt.repeat_interleave(2, 0)) / D_HEAD**0.5
        p = torch.softmax(logits, -1).view(2, 2, 120)  # [Hkv, G, T]
        b = (p * p).sum(1)
        want = threshold_allocate(b.reshape(-1), bv * 2, codec.tree.distortion).view(2, 120)
        mismatches += int((want != st.v_depths[m]).sum())
    assert mismatches <= 2  # float32 vs float64 probabilities may swap one near-tie


def test_duplicating_every_query_head_is_doubling_every_importance(synthetic):
    """G copies of each query head scale all importances by G, which moves no depth (here G = 2, exact)."""
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=80, n_q_heads=2, n_kv_heads=2)
    spec2 = dataclasses.replace(codec.spec, n_q_heads=4)
    codec2 = Codec(spec2, codec.calibration)
    lengths = torch.full((3,), 80)
    pol = ReadPolicy.flexible(2.5)
    out1, st1 = readkv_rows(q, kc, vc, codec, 0, pol, lengths)
    q2 = q.repeat_interleave(2, 0)  # [q0, q0, q1, q1]
    out2, st2 = readkv_rows(q2, kc, vc, codec2, 0, pol, lengths)
    assert torch.equal(st1.k_depths, st2.k_depths)
    assert torch.equal(st1.v_depths, st2.v_depths)
    assert st1.k_bits.tolist() == st2.k_bits.tolist()
    torch.testing.assert_close(out2, out1.repeat_interleave(2, 0), rtol=1e-5, atol=2e-5)


def test_mqa(synthetic):
    codec, q, k, v, kc, vc = _setup(synthetic, n_tokens=150, n_q_heads=4, n_kv_heads=1)
    lengths = torch.full((3,), 150)
    pol = ReadPolicy.flexible(4.0)
    out, st = readkv_rows(q, kc, vc, codec, 0, pol, lengths)
    bk, bv = pol.budgets(150, D_HEAD)
    assert out.shape == (4, 3, D_HEAD)
    assert st.k_bits.tolist() == [150.0 * bk] * 3 and st.v_bits.tolist() == [64.0 * bv] * 3
    dense = attention(q, k, v, lengths)
    full = readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(8.0), lengths)[0]
    assert _rel(full, dense) < 0.05 and _rel(out, dense) < 0.5
    # and through the pages
    cache = PlaneKVCache(codec.spec, 1)
    cache.append(0, kc, vc, seq=0)
    dec, _ = readkv_decode(q[:, :1].permute(1, 0, 2), cache, 0, codec, pol)
    torch.testing.assert_close(dec[0], out[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", [
    ReadPolicy.flexible(3.0), ReadPolicy.constrained(2.0),
    ReadPolicy.flexible(2.0, 0.8, key_variance_correction=True), ReadPolicy.flexible(2.0, 0.8, sink_keys=2),
    ReadPolicy.flexible(2.0, 0.8, key_variance_correction=True, sink_keys=3),
    ReadPolicy.constrained(2.0, sink_keys=1), ReadPolicy.flexible(2.0, 0.875, single_token_values=True),
    ReadPolicy.flexible(2.0, 0.875, key_refine=0.25),
    ReadPolicy.flexible(2.0, 0.875, key_refine=0.25, key_refine_block=16),
    ReadPolicy.constrained(2.0, key_refine=0.3)],
    ids=["flex", "constr", "flex-kvc", "flex-sink", "flex-kvc-sink", "constr-sink", "flex-stv", "flex-kr",
         "flex-kr16", "constr-kr"])
def test_teacher_forced_rows_equal_decode_steps(synthetic, gen, policy):
    n = 70  # crosses the 64-token page boundary
    codec, q, k, v, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    qs = q.expand(-1, n, -1) + 0.3 * torch.randn(8, n, D_HEAD, generator=gen)  # one query per position
    tf, tf_st = readkv_teacher_forced(qs, k, v, codec, 0, policy)
    assert tf.shape == (8, n, D_HEAD)
    rows_out, rows_st = readkv_rows(qs, kc, vc, codec, 0, policy, torch.arange(1, n + 1))
    cache = PlaneKVCache(codec.spec, 1)
    for i in range(n):
        cache.append(0, kc[:, i:i + 1], vc[:, i:i + 1], seq=0)  # the token is appended before its read
        out, st = readkv_decode(qs[:, i][None], cache, 0, codec, policy)
        torch.testing.assert_close(out[0], tf[:, i], rtol=1e-5, atol=2e-5)
        assert float(st.k_bits[0]) == float(tf_st.k_bits[i]) and float(st.v_bits[0]) == float(tf_st.v_bits[i])
        # the same depths, chosen by the same query over the same tokens
        assert torch.equal(st.k_depths[0], rows_st.k_depths[i])
        assert torch.equal(st.extra["v_depths"][0], rows_st.v_depths[i][:, :i + 1])
        assert bool((rows_st.v_depths[i][:, i + 1:] == 0).all())
    torch.testing.assert_close(rows_out, tf, rtol=0, atol=1e-6)


def test_teacher_forced_row_chunk_does_not_matter(synthetic, gen):
    n = 90
    codec, q, k, v, _, _ = _setup(synthetic, n_tokens=n, n_rows=1)
    qs = q.expand(-1, n, -1) + 0.3 * torch.randn(8, n, D_HEAD, generator=gen)
    pol = ReadPolicy.flexible(2.0)
    ref_out, ref_st = readkv_teacher_forced(qs, k, v, codec, 0, pol)
    for chunk in (1, 7, 64, 89):
        out, st = readkv_teacher_forced(qs, k, v, codec, 0, pol, row_chunk=chunk)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-5)
        assert torch.equal(st.k_bits, ref_st.k_bits) and torch.equal(st.v_bits, ref_st.v_bits)
        assert torch.equal(st.tokens, torch.arange(1, n + 1).double())


def test_teacher_forced_window(synthetic, gen):
    n, w = 60, 16
    codec, q, k, v, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    qs = q.expand(-1, n, -1) + 0.3 * torch.randn(8, n, D_HEAD, generator=gen)
    pol = ReadPolicy.flexible(3.0)
    out, st = readkv_teacher_forced(qs, k, v, codec, 0, pol, window=w)
    assert st.tokens.tolist() == [float(min(i + 1, w)) for i in range(n)]
    for i in (0, 5, 15, 16, 40, 59):
        s = max(0, i + 1 - w)
        want, _ = readkv_rows(qs[:, i:i + 1], kc[:, s:i + 1], vc[:, s:i + 1], codec, 0, pol, torch.tensor([i + 1 - s]))
        torch.testing.assert_close(out[:, i], want[:, 0], rtol=1e-5, atol=2e-5)


def test_batched_decode_equals_per_sequence(synthetic, gen):
    codec, q, k, v, _, _ = _setup(synthetic, n_tokens=130, n_rows=1)
    lengths = [5, 64, 130]
    kcs, vcs = [], []
    cache = PlaneKVCache(codec.spec, 3)
    for b, n in enumerate(lengths):
        kb = k[:, :n] + 0.5 * torch.randn(2, n, D_HEAD, generator=gen)
        vb = v[:, :n] * (1 + b)
        kcs.append(codec.encode_k(kb, 0))
        vcs.append(codec.encode_v(vb, 0))
    for b in (2, 0, 1):  # appended out of order, partly in pieces
        cache.append(0, kcs[b][:, :3], vcs[b][:, :3], seq=b)
        cache.append(0, kcs[b][:, 3:], vcs[b][:, 3:], seq=b)
    qb = torch.randn(3, 8, D_HEAD, generator=gen) * 0.5
    pol = ReadPolicy.flexible(2.0)
    out, st = readkv_decode(qb, cache, 0, codec, pol)
    assert out.shape == (3, 8, D_HEAD)
    assert st.tokens.tolist() == [5.0, 64.0, 130.0]
    for b, n in enumerate(lengths):
        single = PlaneKVCache(codec.spec, 1)
        single.append(0, kcs[b], vcs[b], seq=0)
        o1, s1 = readkv_decode(qb[b:b + 1], single, 0, codec, pol)
        torch.testing.assert_close(out[b], o1[0], rtol=0, atol=1e-6)
        assert float(st.k_bits[b]) == float(s1.k_bits[0]) and float(st.v_bits[b]) == float(s1.v_bits[0])
        assert torch.equal(st.k_depths[b], s1.k_depths[0])
        o2, s2 = readkv_rows(qb[b][:, None], kcs[b], vcs[b], codec, 0, pol, torch.tensor([n]))
        torch.testing.assert_close(out[b], o2[:, 0], rtol=1e-5, atol=1e-5)
        bk, bv = pol.budgets(n, D_HEAD)
        assert float(st.k_bits[b]) == n * bk * 2 and float(st.v_bits[b]) == 64 * bv * 2
    # physical bytes counted from the layout, summed over the batch
    want = sum(cache.physical_read_bytes(0, b, st.k_depths[b], st.extra["v_depths"][b]) for b in range(3))
    assert st.physical_bytes == want


def test_decode_reads_only_allocated_planes(synthetic, gen):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=100, n_rows=1)
    cache = PlaneKVCache(codec.spec, 1)
    cache.append(0, kc, vc, seq=0)
    asked = {}

    def read_k(dep):
        asked["k"] = dep.clone()
        return cache.read_k(0, 0, dep)

    def read_v(dep):
        asked["v"] = dep.clone()
        return cache.read_v(0, 0, dep)

    pol = ReadPolicy.flexible(2.0)
    out, st = readkv_rows(q, read_k, read_v, codec, 0, pol, torch.tensor([100]))
    assert torch.equal(asked["k"], st.k_depths[0]) and torch.equal(asked["v"], st.v_depths[0])
    full, _ = readkv_rows(q, kc, vc, codec, 0, pol, torch.tensor([100]))
    torch.testing.assert_close(out, full, rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        readkv_rows(torch.cat([q, q], 1), read_k, read_v, codec, 0, pol, torch.tensor([100, 100]))


def test_constrained_reader_ladder(synthetic):
    n = 151  # odd: one plane of B_V cannot make a packet
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n)
    for rate in (1.0, 2.0, 3.0, 4.0):
        pol = ReadPolicy.constrained(rate)
        assert (pol.min_depth_k, pol.min_depth_v, pol.v_packet, pol.pool_heads) == (1, 1, 2, False)
        bk, bv = pol.budgets(n, D_HEAD)
        _, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.full((3,), n))
        assert int(st.k_depths.min()) >= 1 and int(st.k_depths.max()) <= 8
        assert set(st.v_depths.unique().tolist()) <= {1, 3, 5, 7}
        assert st.k_depths.sum(2).tolist() == [[bk, bk]] * 3  # per head, spent exactly
        v_spent = n + 2 * min((bv - n) // 2, 3 * n)
        assert st.v_depths.sum(2).tolist() == [[v_spent, v_spent]] * 3
        assert st.k_bits.tolist() == [float(n * bk * 2)] * 3
        assert st.v_bits.tolist() == [float(64 * v_spent * 2)] * 3
    with pytest.raises(BudgetError):  # below the minimum depth of 1 for every channel
        readkv_rows(q, kc, vc, codec, 0, ReadPolicy.constrained(0.25), torch.full((3,), n))


def test_reading_with_another_format_raises(synthetic):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=20, n_rows=1)
    cache = PlaneKVCache(codec.spec, 1)
    cache.append(0, kc, vc, seq=0)
    other = Codec(dataclasses.replace(codec.spec, model_id="another-model"), codec.calibration)
    with pytest.raises(FormatMismatch):
        readkv_decode(q.permute(1, 0, 2), cache, 0, other, ReadPolicy.flexible(4.0))
    narrow = FormatSpec(**{**codec.spec.to_dict(), "width": 6})
    with pytest.raises(FormatMismatch):
        readkv_decode(q.permute(1, 0, 2), cache, 0, Codec(narrow, codec.calibration), ReadPolicy.flexible(4.0, width=6))


def test_reader_validates(synthetic):
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=20, n_rows=1)
    one = torch.tensor([20])
    with pytest.raises(ValueError):
        readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(4.0, width=6), one)
    with pytest.raises(ValueError):
        readkv_rows(q[:4], kc, vc, codec, 0, ReadPolicy.flexible(4.0), one)
    with pytest.raises(ValueError):
        readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(4.0), one, starts=torch.tensor([20]))
    cache = PlaneKVCache(codec.spec, 2)
    cache.append(0, kc, vc, seq=0)
    with pytest.raises(ValueError):  # sequence 1 is empty
        readkv_decode(torch.cat([q, q], 1).permute(1, 0, 2), cache, 0, codec, ReadPolicy.flexible(4.0))


def test_width_below_eight(unit_codec, gen):
    codec = unit_codec(n_q_heads=4, n_kv_heads=2, width=4)
    k = torch.randn(2, 70, 64, generator=gen)
    v = torch.randn(2, 70, 64, generator=gen)
    q = torch.randn(4, 2, 64, generator=gen)
    kc, vc = codec.encode_k(k, 0), codec.encode_v(v, 0)
    pol = ReadPolicy.flexible(4.0, width=4)
    lengths = torch.full((2,), 70)
    out, st = readkv_rows(q, kc, vc, codec, 0, pol, lengths)
    assert bool((st.k_depths == 4).all()) and bool((st.v_depths == 4).all())
    want = attention(q, codec.decode(kc, 4, 0, "k"), codec.decode(vc, 4, 0, "v"), lengths)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_value_head_weight_moves_value_bits_to_the_head_with_more_variance() -> None:
    """The named option weights each token's importance by its KV head's total Value variance: with
    equal attention, a pooled budget then gives the high-variance head more Value planes."""
    from planekv.kvstore import Calibration, Codec, FormatSpec, PlaneKVCache, ReadPolicy
    from planekv.kvstore.reference import readkv_decode

    d, hk, t = 16, 2, 32
    ones = torch.ones(1, hk, d)
    sig_v = torch.ones(1, hk, d)
    sig_v[0, 1] = 10.0  # head 1's Values vary 10x more
    cal = Calibration(0 * ones, ones, 0 * ones, sig_v, FormatSpec.seed_k, FormatSpec.seed_v)
    spec = FormatSpec(model_id="t", n_layers=1, n_q_heads=2, n_kv_heads=hk, head_dim=d,
                      calibration_id=cal.calibration_id)
    codec = Codec(spec, cal)
    cache = PlaneKVCache(spec, 1)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(hk, t, d, generator=g)
    cache.append(0, codec.encode_k(kv, 0), codec.encode_v(kv, 0), seq=0)
    q = torch.zeros(1, 2, d)  # uniform attention: identical importance in both heads
    plain, st0 = readkv_decode(q, cache, 0, codec, ReadPolicy.flexible(2.0))
    _, st1 = readkv_decode(q, cache, 0, codec, ReadPolicy.flexible(2.0, value_head_weight=True))
    v0, v1 = st0.extra["v_depths"][0], st1.extra["v_depths"][0]
    assert v1.sum() == v0.sum()  # the same budget
    assert v1[1].sum() > v0[1].sum() and v1[1].sum() > v1[0].sum()


def _manual_full_value_read(codec, q, kc, vc, k_depth, scale, var_correction=False, sink=0, full=None,
                            probs=False):
    """Attention of one query row over codes, Keys at per-channel depths ``k_depth`` [Hkv, d] (the
    first ``sink`` tokens, and the tokens marked in ``full`` [Hkv, T], at depth 8), every Value at
    depth 8, written out from the definitions. ``probs``: return the softmax [Hkv, G, T] instead."""
    hq, d = q.shape[0], q.shape[-1]
    hk = kc.shape[0]
    g = hq // hk
    tab, var = codec.tree.table().double(), codec.tree.variance_table().double()
    mu_k, sig_k = (x.double() for x in codec.stats(0, "k"))
    mu_v, sig_v = (x.double() for x in codec.stats(0, "v"))
    dep = k_depth[:, None, :].expand(kc.shape).clone()  # [Hkv, T, d]
    dep[:, :sink] = 8
    if full is not None:
        dep[full] = 8
    khat = mu_k[:, None] + sig_k[:, None] * tab[dep, kc.long()]
    qt = codec.rot_k.forward(q.float()).double().reshape(hk, g, d)
    logits = scale * torch.einsum("hgd,htd->hgt", qt, khat)
    if var_correction:  # + Var/2, Var = scale^2 sum_c (q~_c sigma_c)^2 Var(Z | node)
        qs2 = (qt * sig_k[:, None]) ** 2
        logits = logits + 0.5 * scale**2 * torch.einsum("hgd,htd->hgt", qs2, var[dep, kc.long()])
    p = torch.softmax(logits, -1)
    if probs:
        return p
    vhat = mu_v[:, None] + sig_v[:, None] * tab[8][vc.long()]
    out = torch.einsum("hgt,htd->hgd", p, vhat).float()
    return codec.rot_v.inverse(out).reshape(hq, d)


def test_key_variance_correction_adds_half_the_logit_variance(synthetic):
    """With every Value read at depth 8, the output is softmax(logits + Var/2) over the Key
    reconstruction, Var from the node variances of each token's codes; and the correction changes
    the output (it is not a no-op on this data)."""
    n = 120
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    base = dict(rate=None, budget_k=150, budget_v=8 * n, reader="flexible")
    scale = 0.2
    out, st = readkv_rows(q, kc, vc, codec, 0, ReadPolicy(**base, key_variance_correction=True),
                          torch.tensor([n]), scale=scale)
    plain, st0 = readkv_rows(q, kc, vc, codec, 0, ReadPolicy(**base), torch.tensor([n]), scale=scale)
    assert torch.equal(st.k_depths, st0.k_depths)  # the correction does not move any depth ...
    dep = st.k_depths[0]
    assert 0 < int((dep == 0).sum()) and int((dep > 0).sum()) > 0
    want = _manual_full_value_read(codec, q[:, 0], kc, vc, dep, scale, var_correction=True)
    torch.testing.assert_close(out[:, 0], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(plain[:, 0], _manual_full_value_read(codec, q[:, 0], kc, vc, dep, scale),
                               rtol=1e-4, atol=1e-5)
    assert _rel(out, plain) > 1e-3  # ... but it changes the output


@pytest.mark.parametrize("sink", [1, 3])
def test_sink_keys_read_at_full_depth_and_paid_from_the_value_budget(synthetic, sink):
    n = 120
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    scale = 0.2
    # Values: full depth is affordable even after the sink's extra Key bits
    pol = ReadPolicy(rate=None, budget_k=150, budget_v=8 * n, reader="flexible", sink_keys=sink)
    out, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.tensor([n]), scale=scale)
    dep = st.k_depths[0]
    want = _manual_full_value_read(codec, q[:, 0], kc, vc, dep, scale, sink=sink)
    torch.testing.assert_close(out[:, 0], want, rtol=1e-4, atol=1e-5)
    extra = sink * (8 - dep).sum()  # Key bits on top of the channel depths
    assert float(st.k_bits[0]) == float(n * dep.sum() + extra)
    # at a rate, the extra Key bits come out of the Value budget: the total stays within it
    for rate in (0.5, 2.0, 4.0):
        pol_r = ReadPolicy.flexible(rate, 0.75, sink_keys=sink)
        _, st_r = readkv_rows(q, kc, vc, codec, 0, pol_r, torch.tensor([n]))
        _, st_p = readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(rate, 0.75), torch.tensor([n]))
        total, budget = float(st_r.total_bits[0]), float(st_p.total_bits[0])
        assert budget - 2 * D_HEAD < total <= budget  # rounded to whole Value planes per head
        assert float(st_r.k_bits[0]) > float(st_p.k_bits[0])


def test_single_token_values_spend_a_one_token_read_on_the_value(synthetic):
    """A row that reads one token: its weight is 1 whatever the Key, so with the option the whole
    2 d R bits per KV head go to the Value (depth 2R), and the output is that Value's reconstruction;
    without it the default split leaves no Value plane at R = 2 (the output is the calibrated mean).
    Rows of more tokens keep the default budgets."""
    codec, q, _, v, kc, vc = _setup(synthetic, n_tokens=40, n_rows=1)
    hk = kc.shape[0]
    on = ReadPolicy.flexible(2.0, 0.875, single_token_values=True)
    off = ReadPolicy.flexible(2.0, 0.875)
    assert on.budgets(1, D_HEAD) == (0, 4) and off.budgets(1, D_HEAD) == (224, 0)
    for t in (2, 3, 40, 1000):
        assert on.budgets(t, D_HEAD) == off.budgets(t, D_HEAD)
    assert ReadPolicy.constrained(2.0, single_token_values=True).budgets(1, D_HEAD) == (D_HEAD, 3)
    out, st = readkv_rows(q, kc, vc, codec, 0, on, torch.tensor([1]))
    assert float(st.k_bits[0]) == 0 and float(st.v_bits[0]) == 4 * D_HEAD * hk  # exactly 2 d R per head
    g = q.shape[0] // hk
    want = codec.decode(vc[:, :1], 4, 0, "v")[:, 0].repeat_interleave(g, 0)  # [Hq, d]
    torch.testing.assert_close(out[:, 0], want, rtol=1e-5, atol=1e-5)
    assert _rel(out[:, 0], v[:, 0].repeat_interleave(g, 0)) < 0.2
    out0, st0 = readkv_rows(q, kc, vc, codec, 0, off, torch.tensor([1]))
    assert float(st0.v_bits[0]) == 0
    mean = codec.decode(vc[:, :1], 0, 0, "v")[:, 0].repeat_interleave(g, 0)
    torch.testing.assert_close(out0[:, 0], mean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", [True, False])
def test_key_refine_reads_the_chosen_tokens_at_full_depth(synthetic, pool):
    """Key refinement, from its definition (ReadPolicy.key_refine): the channel stage gets
    floor((1 - key_refine) B_K) planes; tokens are then taken by benefit per bit,
    sum_g p_{g,i}^2 * var_g / cost, var_g = scale^2 sum_c (q~ sigma)_c^2 D(t_c), cost = sum_c (8 - t_c),
    while B_K - floor(...) planes of T bits per KV head last (pooled: over the heads); those tokens'
    Keys are read at depth 8 and every bit is counted."""
    n = 120
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    hk, d = kc.shape[0], D_HEAD
    g = q.shape[0] // hk
    scale = 0.2
    pol = ReadPolicy(rate=None, budget_k=150, budget_v=8 * n, reader="flexible", key_refine=0.3,
                     pool_heads=pool)
    out, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.tensor([n]), scale=scale)
    dep = st.k_depths[0]  # [Hkv, d]
    stage = int(150 * 0.7)
    plain = ReadPolicy(rate=None, budget_k=stage, budget_v=8 * n, reader="flexible", pool_heads=pool)
    _, st0 = readkv_rows(q, kc, vc, codec, 0, plain, torch.tensor([n]), scale=scale)
    assert torch.equal(dep, st0.k_depths[0])  # the channel stage spends (1 - key_refine) of B_K
    # the selection, written out
    p = _manual_full_value_read(codec, q[:, 0], kc, vc, dep, scale, probs=True)  # [Hkv, G, T]
    qt = codec.rot_k.forward(q[:, 0].float()).double().reshape(hk, g, d)
    sig = codec.stats(0, "k")[1].double()
    dist = torch.tensor(codec.tree.distortion, dtype=torch.float64)
    var = scale**2 * ((qt * sig[:, None]) ** 2 * dist[dep][:, None]).sum(-1)  # [Hkv, G]
    benefit = (p * p * var[..., None]).sum(1)  # [Hkv, T]
    cost = (8 - dep).sum(-1)  # [Hkv]
    items = sorted(((float(benefit[h, i] / cost[h]), h, i) for h in range(hk) for i in range(n)), reverse=True)
    full = torch.zeros(hk, n, dtype=torch.bool)
    left = {h: (150 - stage) * n * (hk if pool else 1) for h in range(hk)}
    for _, h, i in items:
        key = 0 if pool else h
        if left.get(key, -1) < int(cost[h]):
            left[key] = -1  # a prefix of the order: stop at the first block that does not fit
            continue
        left[key] -= int(cost[h])
        full[h, i] = True
    assert 0 < int(full.sum()) < hk * n
    want = _manual_full_value_read(codec, q[:, 0], kc, vc, dep, scale, full=full)
    torch.testing.assert_close(out[:, 0], want, rtol=1e-4, atol=1e-5)
    refined = float((full.sum(1) * cost).sum())
    assert float(st.k_bits[0]) == float(n * dep.sum()) + refined
    assert float(st.k_bits[0]) <= 150 * n * hk


def test_key_refine_with_enough_budget_reads_every_key_at_full_depth(synthetic):
    """Half of B_K = 8d for the channel stage leaves exactly the bits to refine every token: the
    read is then the full-depth Key read."""
    n = 90
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    base = dict(rate=None, budget_v=8 * n, reader="flexible")
    out, st = readkv_rows(q, kc, vc, codec, 0, ReadPolicy(**base, budget_k=8 * D_HEAD, key_refine=0.5),
                          torch.tensor([n]))
    full, st_f = readkv_rows(q, kc, vc, codec, 0, ReadPolicy(**base, budget_k=8 * D_HEAD), torch.tensor([n]))
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    assert float(st.k_bits[0]) == float(st_f.k_bits[0])


@pytest.mark.parametrize("block", [1, 16])
def test_key_refine_stays_within_the_rate(synthetic, block):
    n = 100
    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=n, n_rows=1)
    for rate in (0.5, 2.0, 4.0):
        pol = ReadPolicy.flexible(rate, 0.875, key_refine=0.2, key_refine_block=block)
        _, st = readkv_rows(q, kc, vc, codec, 0, pol, torch.tensor([n]))
        _, st0 = readkv_rows(q, kc, vc, codec, 0, ReadPolicy.flexible(rate, 0.875), torch.tensor([n]))
        assert float(st.total_bits[0]) <= float(st0.total_bits[0])
        if rate >= 2.0:  # (at R = 0.5 a 16-token block costs more than the refinement budget)
            assert float(st.k_bits[0]) > float(st.tokens[0] * st.k_depths[0].sum())  # something was refined


def test_key_refine_options_are_checked():
    with pytest.raises(BudgetError):
        ReadPolicy.flexible(2.0, key_refine=1.0)
    with pytest.raises(BudgetError):
        ReadPolicy.flexible(2.0, key_refine=0.1, key_refine_block=0)
    with pytest.raises(ValueError):
        ReadPolicy.flexible(2.0, key_refine=0.1, sink_keys=1)
    assert ReadPolicy.flexible(2.0, key_refine=0.1).reference_only_options() == []  # in the kernels too
    assert ReadPolicy.flexible(2.0, key_refine=0.1, key_refine_block=16).reference_only_options() == \
        ["key_refine_block"]


def _paged(codec, kc, vc, lengths):
    """A paged cache of ``lengths`` tokens per sequence from codes [Hkv, T, d]."""
    cache = PlaneKVCache(codec.spec, len(lengths))
    for b, t in enumerate(lengths):
        cache.append(0, kc[:, :t], vc[:, :t], seq=b)
    return cache


@pytest.mark.parametrize("policy", [
    ReadPolicy.flexible(2.0, 0.875), ReadPolicy.flexible(4.0, 0.75), ReadPolicy.constrained(2.0),
    ReadPolicy.flexible(2.0, 0.875, key_refine=0.3), ReadPolicy.flexible(4.0, 0.75, sink_keys=4,
                                                                         key_variance_correction=True)],
    ids=["flex-r2", "flex-r4", "cons-r2", "flex-r2-kr", "flex-r4-sink-kvc"])
def test_a_full_residency_reads_exactly_as_none(synthetic, policy):
    """Every plane readable (an all-GPU cache): the same depths, bits and output, bit for bit, and no caps."""
    from planekv.kvstore import Residency

    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=200, n_rows=2)
    lengths = [200, 130]
    cache = _paged(codec, kc, vc, lengths)
    qq = q.transpose(0, 1)[:2].contiguous()  # [B, Hq, d]
    out, st = readkv_decode(qq, cache, 0, codec, policy)
    res = Residency.full(codec.spec, 2, cache.page_table.shape[2])
    out_r, st_r = readkv_decode(qq, cache, 0, codec, policy, residency=res)
    assert torch.equal(out_r, out) and torch.equal(st_r.k_depths, st.k_depths)
    assert all(torch.equal(a, b) for a, b in zip(st_r.extra["v_depths"], st.extra["v_depths"], strict=True))
    assert torch.equal(st_r.k_bits, st.k_bits) and torch.equal(st_r.v_bits, st.v_bits)
    assert not st_r.extra["k_caps"].any() and not st_r.extra["v_caps"].any()
    assert torch.equal(st_r.extra["wanted_bits"], st.k_bits + st.v_bits)
    if policy.key_refine:
        assert all(torch.equal(a, b) for a, b in zip(st_r.extra["k_refined"], st.extra["k_refined"], strict=True))


@pytest.mark.parametrize("tier_aware", [False, True], ids=["capped", "tier-aware"])
def test_a_partial_residency_is_never_passed_and_its_caps_are_counted(synthetic, tier_aware):
    """Key channels readable to 4 planes (some to 8) and Value pages to 2 (every other page to 8): no depth
    passes its limit and the caps are the increments the unlimited read took past the limits. By default
    the depths are the unlimited ones capped; tier-aware, the budget goes to readable increments instead
    (the bits stay the budget while they last)."""
    from planekv.kvstore import Residency

    codec, q, _, _, kc, vc = _setup(synthetic, n_tokens=256, n_rows=2)
    lengths = [256, 200]
    cache = _paged(codec, kc, vc, lengths)
    qq = q.transpose(0, 1)[:2].contiguous()
    policy = ReadPolicy.flexible(4.0, 0.75, tier_aware=tier_aware)
    hk, d, slots = codec.spec.n_kv_heads, codec.spec.head_dim, cache.page_table.shape[2]
    k_depth = torch.full((2, hk, d), 4, dtype=torch.int64)
    k_depth[:, :, ::8] = 8  # a few Key channels promoted
    v_page = torch.full((2, hk, slots), 2, dtype=torch.int64)
    v_page[:, :, ::2] = 8  # every other Value page promoted
    free_out, free = readkv_decode(qq, cache, 0, codec, policy)
    full_k = torch.full_like(k_depth, codec.spec.width)
    full_v = torch.full_like(v_page, codec.spec.width)
    # each stage's caps against the unlimited read, with the other stage unlimited (the same importances)
    _, st_k = readkv_decode(qq, cache, 0, codec, policy, residency=Residency(k_depth, full_v))
    _, st_v = readkv_decode(qq, cache, 0, codec, policy, residency=Residency(full_k, v_page))
    for b, t in enumerate(lengths):
        lim = Residency(k_depth, v_page).v_depth(b, t, codec.spec.page_size)
        # caps in bits: a Key channel plane is t bits, a Value token plane d bits
        assert st_k.extra["k_caps"][b] == t * int((free.k_depths[b] - k_depth[b]).clamp_min(0).sum())
        assert st_v.extra["v_caps"][b] == d * int((free.extra["v_depths"][b] - lim).clamp_min(0).sum())
        assert torch.equal(st_k.extra["k_wanted"][b], free.k_depths[b])
        assert torch.equal(st_v.extra["v_wanted"][b], free.extra["v_depths"][b])
        assert st_k.extra["v_caps"][b] == 0 and st_v.extra["k_caps"][b] == 0
    assert float(st_k.extra["k_caps"].sum()) > 0 and float(st_v.extra["v_caps"].sum()) > 0  # the limits bit
    # both limited
    res = Residency(k_depth, v_page)
    out, st = readkv_decode(qq, cache, 0, codec, policy, residency=res)
    assert bool((st.k_depths <= k_depth).all())
    for b, t in enumerate(lengths):
        assert bool((st.extra["v_depths"][b] <= res.v_depth(b, t, codec.spec.page_size)).all())
    if tier_aware:  # the budget while readable increments last: at R = 4 the Keys can read less than it here
        readable_k = torch.tensor([float(k_depth[b].sum() * t) for b, t in enumerate(lengths)], dtype=torch.float64)
        assert torch.equal(st.k_bits, torch.minimum(free.k_bits, readable_k)) and bool((st.k_bits < free.k_bits).all())
        assert torch.equal(st.v_bits, free.v_bits)  # the Values' readable room remains
    else:  # the unlimited Key depths capped; the Value depths from this read's softmax, capped
        assert torch.equal(st.k_depths, torch.minimum(free.k_depths, k_depth))
        for b, t in enumerate(lengths):
            lim = res.v_depth(b, t, codec.spec.page_size)
            assert torch.equal(st.extra["v_depths"][b], torch.minimum(st.extra["v_wanted"][b], lim))
        assert bool((st.k_bits + st.v_bits < free.k_bits + free.v_bits).all())  # the caps are not spent elsewhere
    # a lower-depth read of the same tokens (half the Value pages at depth 2), not another result: an unrelated
    # output of the same scale is ~1.4 away
    assert _rel(out, free_out) < 0.4
    assert torch.equal(st.extra["wanted_bits"], st.k_bits + st.v_bits + st.extra["k_caps"] + st.extra["v_caps"])
    with pytest.raises(ValueError, match="residency"):
        readkv_decode(qq, cache, 0, codec, policy, residency=Residency(k_depth[:1], v_page[:1]))


@pytest.mark.parametrize("extra", [dict(key_refine=0.3), dict(sink_keys=8)], ids=["key-refine", "sink-keys"])
def test_refined_and_sink_keys_are_read_at_the_resident_depth(synthetic, extra):
    """Under a residency without Key pages, Key refinement and sink Keys read each channel at its resident
    depth (never past it: the cache would refuse), count the planes past it as caps (refinement's in
    ``kr_caps``: the tokens the unlimited choice takes), and the read stays close to the unlimited one."""
    from planekv.kvstore import Residency

    codec, q, k, v, kc, vc = _setup(synthetic, n_tokens=256, n_rows=2)
    lengths = [256, 190]
    cache = _paged(codec, kc, vc, lengths)
    qq = q.transpose(0, 1)[:2].contiguous()
    policy = ReadPolicy.flexible(2.0, 0.875, **extra)
    spec = codec.spec
    hk, d, w, slots = spec.n_kv_heads, spec.head_dim, spec.width, cache.page_table.shape[2]
    k_depth = torch.full((2, hk, d), 6, dtype=torch.int64)
    k_depth[:, :, ::4] = 7
    res = Residency(k_depth, torch.full((2, hk, slots), w, dtype=torch.int64))
    asked: list[torch.Tensor] = []
    read_k = cache.read_k

    def spying_read_k(layer, b, depth):
        asked.append(torch.as_tensor(depth).expand(hk, d) - k_depth[b])
        return read_k(layer, b, depth)

    cache.read_k = spying_read_k
    free_out, _ = readkv_decode(qq, cache, 0, codec, policy)
    asked.clear()
    out, st = readkv_decode(qq, cache, 0, codec, policy, residency=res)
    assert asked and all(int(x.max()) <= 0 for x in asked)  # no plane past the residency was fetched
    past = (w - k_depth).sum(-1)  # [B, Hkv] planes past the residency per token
    for b in range(2):
        if "key_refine" in extra:
            n_ref = st.extra["k_refined"][b].sum(-1)  # [Hkv] tokens refined per head
            assert int(n_ref.sum()) > 0
            assert torch.equal(st.extra["kr_wanted"][b], st.extra["k_refined"][b])  # capped, not re-chosen
            assert not st.extra["kr_full"][b].any()  # no Key page resident: every refined token capped
            assert float(st.extra["kr_caps"][b]) == float((n_ref * past[b]).sum())
        else:
            assert float(st.extra["k_caps"][b]) >= 8 * float(past[b].sum())
    exact = torch.stack([attention(qq[b][:, None], k[:, :t], v[:, :t], torch.tensor([t]))[:, 0]
                         for b, t in enumerate(lengths)])
    assert _rel(out, exact) < 1.25 * _rel(free_out, exact)  # resident depths 6-7 of 8 cost little
