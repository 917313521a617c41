"""The Key-refinement stage in the kernels (planekv.kernels.refine, ReadPolicy.key_refine) against
the reference reader: the same tokens refined, the same bits, outputs within float32 tolerance."""

from __future__ import annotations

import pytest
import torch

from planekv.kernels import ReaderConfig, TritonReader
from planekv.kvstore import ReadPolicy
from planekv.kvstore.reference import readkv_decode

from .test_reader import _setup

CASES = {
    # name: (policy, query heads, KV heads)
    "flexible-r2-g2": (ReadPolicy.flexible(2.0, 0.875, key_refine=0.3), 4, 2),
    "constrained-r2-mha": (ReadPolicy.constrained(2.0, key_refine=0.3), 4, 4),
    "flexible-r4-g3-mqa": (ReadPolicy.flexible(4.0, 0.75, key_refine=0.5), 3, 1),
    "flexible-r2-g8": (ReadPolicy.flexible(2.0, 0.875, key_refine=0.2), 16, 2),
}


def _refined_ref(rst, lengths: list[int]) -> list[torch.Tensor]:
    return [m[:, :t] for m, t in zip(rst.extra["k_refined"], lengths, strict=True)]


def _run(policy: ReadPolicy, codec, cache, q, lengths: list[int]):
    reader = TritonReader(codec, policy)
    page = cache.spec.page_size
    # a Key program of 2 pages and refinement/Value blocks of one page: selection across many blocks
    plan = reader.plan(len(lengths), max(lengths), "cpu", pages_per_program=2, block_tokens=page)
    plan.out.fill_(float("nan"))
    plan.logits.fill_(float("nan"))
    out, st = reader.decode(q, cache, 0, plan=plan)
    return out, st, plan


@pytest.mark.parametrize("name", list(CASES))
def test_key_refinement_matches_the_reference(name: str) -> None:
    policy, hq, hk = CASES[name]
    lengths = [150, 97]
    codec, cache, q = _setup(seed=len(name) * 7 + hq, lengths=lengths, hq=hq, hk=hk)
    ref, rst = readkv_decode(q, cache, 0, codec, policy)
    out, st, _ = _run(policy, codec, cache, q, lengths)
    assert torch.isfinite(out).all()
    for b, want in enumerate(_refined_ref(rst, lengths)):
        got = st.extra["k_refined"][b, :, : lengths[b]]
        assert 0 < int(want.sum()) < want.numel()  # some tokens refined, not all
        assert torch.equal(got, want), f"sequence {b}: {int((got ^ want).sum())} tokens differ"
    assert torch.equal(st.k_depths, rst.k_depths)
    assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)
    assert st.bits_per_scalar <= policy.rate + 1e-9  # refinement bits are paid from the Key budget
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # the stage matters: without it the same budget gives a visibly different output
    base = ReadPolicy(**{**policy.to_dict(), "key_refine": 0.0})
    ref0, _ = readkv_decode(q, cache, 0, codec, base)
    assert ((ref0 - ref).norm() / ref.norm()).item() > 1e-3


def test_refinement_ties_follow_the_reference_order() -> None:
    """Peaked queries put p = 0 exactly on almost every token, so almost every refinement key is 0
    and the budget reaches those ties: the kernel takes them in (head, position) order, as the
    reference's stable sort, and stops at the first that does not fit."""
    lengths = [150]
    codec, cache, q = _setup(seed=21, lengths=lengths)
    q = q * 300.0
    for policy in (ReadPolicy.flexible(2.0, 0.875, key_refine=0.3), ReadPolicy.constrained(2.0, key_refine=0.3)):
        ref, rst = readkv_decode(q, cache, 0, codec, policy)
        want = _refined_ref(rst, lengths)[0]
        g = codec.spec.group_size
        assert int(want.sum()) > want.shape[0] * g  # more than the tokens any query head weights: ties taken
        out, st, _ = _run(policy, codec, cache, q, lengths)
        assert torch.equal(st.extra["k_refined"][0, :, :150], want)
        assert torch.equal(st.k_bits, rst.k_bits)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_refinement_options_the_kernels_lack_are_refused() -> None:
    codec, _, _ = _setup(seed=1, lengths=[64])
    with pytest.raises(ValueError, match="key_refine_block"):
        TritonReader(codec, ReadPolicy.flexible(2.0, key_refine=0.2, key_refine_block=16))
    with pytest.raises(ValueError, match="FMA"):
        TritonReader(codec, ReadPolicy.flexible(2.0, key_refine=0.2), config=ReaderConfig(assembly="transpose"))
    with pytest.raises(ValueError, match="no Key refinement"):
        r = TritonReader(codec, ReadPolicy.flexible(2.0))
        r.refined(r.plan(1, 64, "cpu"))


def test_physical_bytes_count_the_refined_pages() -> None:
    """A refined token costs the rows of its page's planes below W that the channel depths left
    unread (every channel), once per page however many of its tokens are refined."""
    lengths = [150]
    codec, cache, q = _setup(seed=5, lengths=lengths)
    policy = ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)
    _, rst = readkv_decode(q, cache, 0, codec, policy)
    kdep, vdep = rst.k_depths[0], rst.extra["v_depths"][0]
    refined = rst.extra["k_refined"][0]
    p, w = cache.spec.page_size, cache.spec.width
    pages = torch.nn.functional.pad(refined, (0, -150 % p)).view(refined.shape[0], -1, p).any(-1).sum(1)
    extra = int((pages * (w - kdep).sum(-1)).sum()) * (p // 8)
    assert extra > 0
    assert rst.physical_bytes == cache.physical_read_bytes(0, 0, kdep, vdep) + extra
