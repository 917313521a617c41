"""Prefix reuse through the transformers cache: a second cache whose prompt starts with stored whole pages (same
format, same read mode) loads them, runs the model on the rest of the prompt only, and generates what a fresh
compressed prefill generates: the same tokens, the loaded codes bit for bit, logits within float32 rounding (the
suffix's linear layers run on fewer rows than a fresh prefill's, which can change the last bits: up to 2e-7 seen
here); another format or read mode never matches; a prefix shorter than a page reuses nothing; a dense prefill
refuses reuse."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from planekv.kvstore import CacheFull, Codec, ReadPolicy  # noqa: E402
from planekv.kvstore.reference import ReadKV, make_system  # noqa: E402
from planekv.models import hf  # noqa: E402
from planekv.tiering import PrefixIndex, TieredCache  # noqa: E402
from planekv.tiering.replace import stored_codes  # noqa: E402

from ..tiering.test_remote_tier import FakeRemote  # noqa: E402
from .conftest import VOCAB, codec_for  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values

P = 64
POLICY = ReadPolicy.flexible(4.0)
NEW = 3  # greedy tokens generated after the prompt


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _forward_tokens(model) -> Iterator[list[int]]:
    """Counts the token positions the model runs (its input embedding's inputs)."""
    seen = [0]
    handle = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.__setitem__(0, seen[0] + args[0].numel()))
    try:
        yield seen
    finally:
        handle.remove()


def _generate(model, cache, ids: torch.Tensor):
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def _fresh_then_reused(model, codec: Codec, ids: torch.Tensor, tiering: hf.Tiering | None = None):
    """Generate after a fresh compressed prefill (publishing its pages), then in a second cache after reusing them:
    (fresh output, reused output, tokens reused, positions run fresh, positions run reused, both caches)."""
    system = ReadKV(codec, POLICY)
    index = PrefixIndex()
    fresh = hf.make_cache(model, system, dense_prefill=False, tiering=tiering)
    with _forward_tokens(model) as ran_fresh:
        a = _generate(model, fresh, ids)
    assert hf.publish_prefix(fresh, index, a.sequences) == (ids.shape[1] + NEW - 1) // P
    second = hf.make_cache(model, system, dense_prefill=False, tiering=tiering)
    with _forward_tokens(model) as ran_reused:
        n = hf.reuse_prefix(second, index, ids)
        b = _generate(model, second, ids)
    return a, b, n, ran_fresh[0], ran_reused[0], fresh, second


def _same_outputs(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)  # float32 rounding of a smaller matmul, at most


def _same_prefix_codes(first, second, n: int) -> None:
    """The first n tokens' codes of sequence 0, every layer, bit for bit (wherever their planes live)."""
    for layer in range(len(first.layers)):
        (k1, v1), (k2, v2) = (_codes(c.pages, layer) for c in (first, second))
        assert torch.equal(k1[:, :n], k2[:, :n]) and torch.equal(v1[:, :n], v2[:, :n])


def _codes(pages, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(pages, TieredCache):
        return stored_codes(pages, layer, 0)
    return pages.read_k(layer, 0, 8), pages.read_v(layer, 0, 8)


@pytest.mark.parametrize("which,n_tokens", [("llama", 2 * P + 12), ("gemma", P + 10)])
def test_a_reused_prefix_generates_what_a_fresh_prefill_does(which, n_tokens, request) -> None:
    model, codec = request.getfixturevalue(which)  # gemma: a sliding-window layer reads the loaded tokens too
    ids = _ids(n_tokens)
    a, b, n, ran_fresh, ran_reused, fresh, second = _fresh_then_reused(model, codec, ids)
    assert n == (n_tokens // P) * P
    _same_outputs(a, b)
    _same_prefix_codes(fresh, second, n)
    assert ran_fresh == n_tokens + NEW - 1
    assert ran_reused == n_tokens - n + NEW - 1  # the prefix was loaded, not computed again
    assert second.pages.length(0, 0) == n_tokens + NEW - 1


def test_a_tiered_cache_loads_hot_planes_to_the_pool_and_refinement_planes_to_the_host_tier(llama) -> None:
    model, codec = llama
    ids = _ids(P + 6, seed=5)
    # Key pages and Value pages all fit on the device: no read is capped, so reuse is bit for bit (TIERING.md)
    tiering = hf.Tiering(hot=2, max_tokens=256, key_page_bytes=8 << 20)
    system = ReadKV(codec, POLICY)
    a, b, n, _, ran_reused, fresh, second = _fresh_then_reused(model, codec, ids, tiering)
    assert n == P and ran_reused == 6 + NEW - 1
    _same_outputs(a, b)
    tc = second.pages
    assert tc.bytes().host > 0 and tc.host.page((tc.sequence_ids[0], "k", 0, 0), 0).numel() > 0
    _same_prefix_codes(fresh, second, P)
    # the loaded page is sealed like a computed one: one seal per layer before the suffix ran
    index = PrefixIndex()
    hf.publish_prefix(fresh, index, a.sequences)
    third = hf.make_cache(model, system, dense_prefill=False, tiering=tiering)
    assert hf.reuse_prefix(third, index, ids) == P
    assert third.pages.counters["sealed"] == codec.spec.n_layers and third.pages.bytes().host > 0


@pytest.fixture(scope="module")
def published(llama) -> tuple[PrefixIndex, torch.Tensor]:
    """An index holding the two whole pages of a 140-token prompt (llama, compressed prefill at R = 4), and the
    prompt; ``FRESH_LOGITS`` keeps the fresh prefill's logits."""
    model, codec = llama
    ids = _ids(2 * P + 12, seed=7)
    index = PrefixIndex()
    logits, n = hf.prefill_with_reuse(model, hf.make_cache(model, ReadKV(codec, POLICY), dense_prefill=False),
                                      ids, index)
    assert n == 0 and logits.shape[1] == ids.shape[1] and len(index) == 2
    FRESH_LOGITS[:] = [logits]
    return index, ids


FRESH_LOGITS: list[torch.Tensor] = []


def test_another_worker_reuses_the_pages_through_a_remote_tier(llama, published) -> None:
    """Worker 1 publishes to a remote tier (the store service in deployment; an in-memory fake here), worker 2's
    own index finds the pages there and gives the fresh prefill's logits."""
    model, codec = llama
    index, ids = published
    remote = FakeRemote()
    system = ReadKV(codec, POLICY)
    worker1 = PrefixIndex(remote=remote, spec=codec.spec)
    for key in hf.prefix_keys(hf.make_cache(model, system, dense_prefill=False), ids[0]):
        worker1.put(key, index.get(key))
    assert len(remote.frames) == 4
    worker2 = PrefixIndex(remote=remote, spec=codec.spec)
    with _forward_tokens(model) as ran:
        logits, n = hf.prefill_with_reuse(model, hf.make_cache(model, system, dense_prefill=False), ids, worker2)
    assert (n, ran[0], worker2.stats.remote_hits) == (2 * P, 12, 2)
    torch.testing.assert_close(logits, FRESH_LOGITS[0][:, n:], atol=1e-5, rtol=1e-5)


def test_another_format_or_read_mode_never_matches(llama, published) -> None:
    model, codec = llama
    index, ids = published
    spec = codec.spec
    w6 = ReadPolicy.flexible(3.0, width=6)
    other_calibration = codec_for(model, n_tokens=128)
    assert other_calibration.spec.format_id != spec.format_id
    systems = {
        "calibration": ReadKV(other_calibration, POLICY),
        "codebook": ReadKV(Codec(dataclasses.replace(spec, codebook="uniform-linear-c3"), codec.calibration), POLICY),
        "width": ReadKV(Codec(dataclasses.replace(spec, width=6), codec.calibration), w6),
        "page size": ReadKV(Codec(dataclasses.replace(spec, page_size=128), codec.calibration), POLICY),
        "read policy": ReadKV(codec, ReadPolicy.flexible(2.0)),
    }
    for what, system in systems.items():
        cache = hf.make_cache(model, system, dense_prefill=False)
        assert hf.reuse_prefix(cache, index, ids) == 0, what
        assert cache.pages is None and cache.get_seq_length() == 0, what
    tiered = hf.make_cache(model, ReadKV(codec, POLICY), dense_prefill=False, tiering=hf.Tiering(hot=8,
                                                                                                  max_tokens=256))
    assert hf.reuse_prefix(tiered, index, ids) == 0  # a tiered cache's reads cap: another producer
    same = hf.make_cache(model, ReadKV(codec, POLICY), dense_prefill=False)
    assert hf.reuse_prefix(same, index, ids) == 2 * P


def test_only_whole_pages_of_a_common_prefix_are_reused(llama, published) -> None:
    model, codec = llama
    index, ids = published
    system = ReadKV(codec, POLICY)

    def reused(prompt: torch.Tensor) -> int:
        return hf.reuse_prefix(hf.make_cache(model, system, dense_prefill=False), index, prompt)

    tail = _ids(20, seed=11)
    assert reused(torch.cat([ids[:, :P], tail], 1)) == P  # page 0 in common, page 1 not
    assert reused(torch.cat([ids[:, :P - 1], tail], 1)) == 0  # shorter than a page: nothing
    assert reused(ids[:, :P]) == 0  # the prompt's last token always runs (its logits), so its last page cannot load
    assert reused(ids[:, :P + 1]) == P
    changed = ids.clone()
    changed[0, 3] = (changed[0, 3] + 1) % VOCAB
    assert reused(changed) == 0  # a token of page 0 differs: no page matches (the keys chain)


def test_a_partial_match_gives_the_fresh_outputs(llama, published) -> None:
    model, codec = llama
    index, ids = published
    prompt = torch.cat([ids[:, :P], _ids(6, seed=13)], 1)
    system = ReadKV(codec, POLICY)
    fresh, n0 = hf.prefill_with_reuse(model, hf.make_cache(model, system, dense_prefill=False), prompt,
                                      PrefixIndex())
    with _forward_tokens(model) as ran:
        reused, n = hf.prefill_with_reuse(model, hf.make_cache(model, system, dense_prefill=False), prompt, index)
    assert (n0, n, ran[0]) == (0, P, 6)
    torch.testing.assert_close(reused, fresh[:, P:], atol=1e-5, rtol=1e-5)
    assert torch.equal(reused[0, -1].argmax(), fresh[0, -1].argmax())
    assert len(index) == 2  # the new prompt holds no second whole page: nothing published


def test_a_prefix_shorter_than_a_page_is_never_published(llama) -> None:
    model, codec = llama
    index = PrefixIndex()
    system = ReadKV(codec, POLICY)
    _, n = hf.prefill_with_reuse(model, hf.make_cache(model, system, dense_prefill=False), _ids(40), index)
    assert n == 0 and len(index) == 0
    assert hf.reuse_prefix(hf.make_cache(model, system, dense_prefill=False), index, _ids(90)) == 0


def test_reuse_is_refused_where_it_cannot_give_the_fresh_outputs(llama, published) -> None:
    model, codec = llama
    index, ids = published
    with pytest.raises(ValueError, match="dense_prefill=False"):
        hf.reuse_prefix(hf.make_cache(model, ReadKV(codec, POLICY)), index, ids)  # dense prefill
    with pytest.raises(ValueError, match="ReadKV"):
        hf.reuse_prefix(hf.make_cache(model, make_system("kivi", 4.0, codec), dense_prefill=False), index, ids)
    with pytest.raises(ValueError, match="one prompt"):
        hf.reuse_prefix(hf.make_cache(model, ReadKV(codec, POLICY), dense_prefill=False), index, ids.repeat(2, 1))


@pytest.mark.parametrize("which", ["llama", "gemma"])
@pytest.mark.parametrize("policy", [POLICY, ReadPolicy.flexible(2.0, key_refine=0.25)])
def test_a_chunk_read_as_causal_rows_gives_the_token_by_token_outputs(which, policy, request) -> None:
    """A compressed prefill (and a later step of several tokens) stored whole and read as causal rows: the logits
    of the token-by-token loop to float32 rounding (measured: <= 5e-7 on these models), its codes (to a code at a
    boundary), the same logical read; gemma's sliding-window layer reads its window per row."""
    model, codec = request.getfixturevalue(which)
    system = ReadKV(codec, policy)
    ids = _ids(2 * P + 20)
    runs = {}
    for rows in (False, True):
        cache = hf.make_cache(model, system, dense_prefill=False)
        cache.row_reads = rows
        calls = []
        cache._read = lambda *a, _f=cache._read, _c=calls: _c.append(1) or _f(*a)  # the token-by-token read
        with torch.no_grad():
            first = model(ids, past_key_values=cache, use_cache=True).logits
            chunk = model(ids[:, :5], past_key_values=cache, use_cache=True).logits  # a step of 5 tokens
            step = model(ids[:, :1], past_key_values=cache, use_cache=True).logits  # a decode step: token by token
        runs[rows] = (first, chunk, step, cache, len(calls))
    (a1, a2, a3, ca, na), (b1, b2, b3, cb, nb) = runs[False], runs[True]
    n_layers = len(ca.layers)
    assert na == (ids.shape[1] + 6) * n_layers and nb == n_layers  # only the decode step read token by token
    for x, y in ((a1, b1), (a2, b2), (a3, b3)):
        torch.testing.assert_close(y, x, atol=2e-6, rtol=0)
        assert torch.equal(x.argmax(-1), y.argmax(-1))
    # layer 0's codes come from the embeddings: bit for bit; a later layer's from hidden states that differ in the
    # last bits, which can move a value across a code boundary (measured: 1 Key code of 4736 in layer 1, key_refine)
    n = ids.shape[1] + 6
    for layer in range(n_layers):
        (k1, v1), (k2, v2) = _codes(ca.pages, layer), _codes(cb.pages, layer)
        differ = int((k1[:, :n] != k2[:, :n]).sum() + (v1[:, :n] != v2[:, :n]).sum())
        assert differ == 0 if layer == 0 else differ <= 2e-3 * (k1.numel() + v1.numel())
    assert (ca.tally.k_bits, ca.tally.v_bits, ca.tally.rows) == (cb.tally.k_bits, cb.tally.v_bits, cb.tally.rows)


def test_reuse_with_row_reads_matches_a_fresh_prefill_and_a_load_that_does_not_fit_loses_nothing(llama) -> None:
    """The suffix after a loaded prefix runs as rows (one read per layer), and gives the fresh compressed prefill's
    first token and logits (to float32 rounding); a cache too small for the prefix is left empty, the index
    keeps the pages, and another cache still reuses them."""
    model, codec = llama
    system = ReadKV(codec, POLICY)
    ids = _ids(2 * P + 12, seed=11)
    index = PrefixIndex()
    fresh = hf.make_cache(model, system, dense_prefill=False)
    logits, n0 = hf.prefill_with_reuse(model, fresh, ids, index)
    assert n0 == 0 and len(index) == 2
    small = hf.make_cache(model, system, dense_prefill=False)
    small._admit(1)
    small.pages.max_pages = small.pages.n_pages  # a pool of one free page: the prefix's pages do not fit
    small.pages._free = small.pages._free[-1:]
    with pytest.raises(CacheFull):
        hf.reuse_prefix(small, index, ids)
    assert small.pages.length(0, 0) == 0 and not bool((small.pages.page_table >= 0).any())
    assert small.get_seq_length() == 0 and len(small.pages._free) == 1  # left empty, its page free
    assert len(index) == 2 and len(index.match(hf.prefix_keys(fresh, ids[0]), codec.spec.format_id)) == 2
    second = hf.make_cache(model, system, dense_prefill=False)
    reads = []
    second._read_rows = lambda *a, _f=second._read_rows: reads.append(1) or _f(*a)
    got, n = hf.prefill_with_reuse(model, second, ids, index, publish=False)
    assert n == 2 * P and len(reads) == len(second.layers)
    torch.testing.assert_close(got[0, -1], logits[0, -1], atol=1e-5, rtol=0)
    assert int(got[0, -1].argmax()) == int(logits[0, -1].argmax())
