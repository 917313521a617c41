"""A tiered transformers cache follows a live placement policy: a new version given by ``Tiering.policy_source``
is applied before the next decode step reads (every stored code moves; the tokens are those of a cache made under
the new policy); a version that cannot be applied, or a source that fails, leaves the placement as it was and no
step fails."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from planekv.kvstore import ReadPolicy  # noqa: E402
from planekv.kvstore.reference import ReadKV  # noqa: E402
from planekv.models import hf  # noqa: E402
from planekv.tiering import PlacementPolicy  # noqa: E402

from .conftest import VOCAB  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

POLICY = ReadPolicy.flexible(4.0)
SHALLOW = PlacementPolicy(hot_planes={"k": 2, "v": 2}, block_bytes=1 << 20)
DEEP = PlacementPolicy(hot_planes={"k": 8, "v": 8}, block_bytes=1 << 20)  # every plane on the device
NEW = 6


class Source:
    """Answers ``plan[call]`` (None before any entry; the last entry after the plan ends); counts its calls."""

    def __init__(self, plan: dict[int, object]) -> None:
        self.plan, self.calls = plan, 0

    def __call__(self):
        self.calls += 1
        got = None
        for at in sorted(self.plan):
            if at <= self.calls:
                got = self.plan[at]
        if isinstance(got, Exception):
            raise got
        return got


def _generate(model, codec, placement: PlacementPolicy | None, source=None, ids=None):
    ids = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(7)) if ids is None else ids
    tiering = None if placement is None else hf.Tiering(hot=placement.hot_planes.k, max_tokens=200,
                                                         placement=placement, policy_source=source)
    cache = hf.make_cache(model, ReadKV(codec, POLICY), tiering=tiering)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    return out[:, ids.shape[1]:], cache


def test_a_new_version_applies_before_the_next_decode_step(llama):
    """Activated before the first decode step, the deep version is read by that step: the tokens are those of an
    untiered cache (everything resident, no cap) and not those of the shallow placement, which caps."""
    model, codec = llama
    shallow, shallow_cache = _generate(model, codec, SHALLOW)
    untiered, _ = _generate(model, codec, None)
    source = Source({1: (2, DEEP)})
    moved, cache = _generate(model, codec, SHALLOW, source)
    assert source.calls == NEW - 1  # asked before every decode step (the first token comes from the prefill)
    assert cache.policy_version == 2 and cache.pages.placement == DEEP and cache.pages.hot_k == [8, 8]
    assert torch.equal(moved, untiered)
    assert cache.tier_tally.cap_rate == 0.0 and shallow_cache.tier_tally.cap_rate > 0.0


def test_a_version_activated_mid_generation_moves_every_stored_code(llama):
    """A switch at the third decode step keeps every token stored so far (the cache holds the same codes under
    the new placement) and the steps before it read under the old one."""
    model, codec = llama
    source = Source({3: (5, DEEP)})
    tokens, cache = _generate(model, codec, SHALLOW, source)
    assert cache.policy_version == 5 and cache.pages.hot_v == [8, 8]
    assert all(cache.pages.length(layer, 0) == 150 + NEW - 1 for layer in range(2))
    shallow, _ = _generate(model, codec, SHALLOW)
    assert torch.equal(tokens[:, :3], shallow[:, :3])  # the prefill's token and two decode steps before the switch


@pytest.mark.parametrize("bad", ["format", "source"])
def test_a_version_that_cannot_apply_or_a_failing_source_keeps_the_placement(llama, bad):
    """A version for another format is refused once (recorded, not retried every step); a source that raises (the
    control plane away) is logged. Either way every step reads under the old placement: the tokens are the
    shallow cache's."""
    model, codec = llama
    shallow, _ = _generate(model, codec, SHALLOW)
    entry = ((3, PlacementPolicy(format_id="0123456789abcdef", hot_planes={"k": 8, "v": 8}))
             if bad == "format" else ConnectionError("control plane away"))
    tokens, cache = _generate(model, codec, SHALLOW, Source({1: entry}))
    assert torch.equal(tokens, shallow)
    assert cache.policy_version == 0 and cache.pages.placement == SHALLOW
    if bad == "format":
        assert list(cache.policy_refusals) == [3] and "0123456789abcdef" in cache.policy_refusals[3]
    else:
        assert cache.policy_refusals == {}
