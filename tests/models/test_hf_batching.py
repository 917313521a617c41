"""The PlaneKV transformers cache driven as DynamicCache is: left-padded batches (pads never stored, read or
counted), beam search, num_return_sequences, batch_select_indices, batch_repeat_interleave and crop (assisted
decoding). At full depth (R = W = 8: every plane read) each gives DynamicCache's tokens; a tiered cache refuses
the edits it cannot make yet."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from planekv.kvstore import ReadPolicy  # noqa: E402
from planekv.kvstore.reference import ReadKV, make_system  # noqa: E402
from planekv.models import hf  # noqa: E402

from .conftest import VOCAB  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values

FULL = ReadPolicy.flexible(8.0)  # reads every plane of the 8-bit codes


def _prompts(*lengths: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]  # no pad (0) or EOS (2) token


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [B, N] of the prompts padded on the left with token 0."""
    n = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, n - p.numel():] = p
        mask[i, n - p.numel():] = 1
    return ids, mask


def _generate(model, cache, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = 6,
              **kw) -> torch.Tensor:
    """The new tokens [B', new] of greedy (or ``kw``) generation through ``cache``; no early EOS."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:]


def _step(model, cache, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One forward of ids [B, S] with the mask [B, past + S] of every position: the last logits [B, V]."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1]:]
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]


def _close(pk: torch.Tensor, dense: torch.Tensor, tol: float = 1e-2) -> None:
    """PlaneKV at full depth against dense logits [B, V]: the same greedy tokens, logits within the code error."""
    assert torch.equal(pk.argmax(-1), dense.argmax(-1))
    assert float((pk - dense).norm() / dense.norm()) < tol


@pytest.mark.parametrize("system", ["readkv", "fp16-baseline"])
def test_left_padded_batch_equals_each_prompt_alone_and_dense(llama, system):
    """Two prompts of different lengths, padded on the left, decode as each alone and as DynamicCache: the
    shorter prompt's pads are never read (before the fix they were, and it continued differently)."""
    model, codec = llama
    make = (lambda: ReadKV(codec, FULL)) if system == "readkv" else (lambda: make_system("dense", 16))
    prompts = _prompts(12, 7)
    ids, mask = _left_padded(prompts)
    dense = _generate(model, DynamicCache(config=model.config), ids, mask)
    cache = hf.make_cache(model, make())
    batch = _generate(model, cache, ids, mask)
    assert torch.equal(batch, dense)
    for i, p in enumerate(prompts):
        assert torch.equal(_generate(model, hf.make_cache(model, make()), p[None]), batch[i:i + 1])
    if system == "readkv":
        assert cache.pages is not None
        assert [cache.pages.length(0, b) for b in range(2)] == [12 + 5, 7 + 5]  # prompt + 5 decode steps, no pad


def test_pads_are_not_counted_in_the_tally(llama):
    """The read of a padded batch is the sum of each prompt's read alone (bits, dense bits and rows)."""
    model, codec = llama
    policy = ReadPolicy.flexible(4.0)
    prompts = _prompts(12, 7)
    ids, mask = _left_padded(prompts)
    batch = hf.make_cache(model, ReadKV(codec, policy))
    tokens = _generate(model, batch, ids, mask)
    alone = [hf.make_cache(model, ReadKV(codec, policy)) for _ in prompts]
    for i, (p, cache) in enumerate(zip(prompts, alone, strict=True)):
        assert torch.equal(_generate(model, cache, p[None]), tokens[i:i + 1])
    assert batch.tally.rows == sum(c.tally.rows for c in alone) == 2 * 5 * 2  # sequences x steps x layers
    assert batch.tally.dense_bits == sum(c.tally.dense_bits for c in alone)
    assert batch.tally.k_bits + batch.tally.v_bits == pytest.approx(
        sum(c.tally.k_bits + c.tally.v_bits for c in alone), rel=1e-12)
    assert batch.tally.bits_per_scalar == pytest.approx(4.0, abs=0.05)


def test_sliding_window_padded_batch_equals_each_prompt_alone(gemma):
    """Gemma3's sliding-window layer (window 8) counts its window in positions: a left-padded batch of prompts
    longer than the window decodes as each prompt alone."""
    model, codec = gemma
    prompts = _prompts(14, 9)
    ids, mask = _left_padded(prompts)
    batch = _generate(model, hf.make_cache(model, ReadKV(codec, FULL)), ids, mask)
    for i, p in enumerate(prompts):
        assert torch.equal(_generate(model, hf.make_cache(model, ReadKV(codec, FULL)), p[None]), batch[i:i + 1])


def test_triton_reader_reads_a_padded_batch(gemma):
    """reader="triton" reads per-sequence lengths of stored tokens, so a padded batch reads no pad: its decode
    logits are the reference reader's (Triton's interpreter without a GPU)."""
    model, codec = gemma
    policy = ReadPolicy.flexible(3.0)
    ids, mask = _left_padded(_prompts(7, 4))  # shorter than the window: both layers read through the reader
    logits = {}
    for reader in ("reference", "triton"):
        cache = hf.make_cache(model, ReadKV(codec, policy), reader=reader)
        first = _step(model, cache, ids, mask).argmax(-1, keepdim=True)  # [B, 1]
        logits[reader] = _step(model, cache, first, torch.cat([mask, torch.ones_like(first)], 1))
    assert float((logits["triton"] - logits["reference"]).norm() / logits["reference"].norm()) < 1e-4


@pytest.mark.parametrize("returned", [1, 2])
@pytest.mark.parametrize("system", ["readkv", "fp16-baseline"])
def test_beam_search_equals_dense(llama, system, returned):
    """num_beams = 2 (reorder_cache every step, a beam taken twice copied), returning one or both beams, on a
    left-padded batch: DynamicCache's sequences."""
    model, codec = llama
    kv = ReadKV(codec, FULL) if system == "readkv" else make_system("dense", 16)
    ids, mask = _left_padded(_prompts(12, 7))
    kw = dict(num_beams=2, num_return_sequences=returned, do_sample=False)
    dense = _generate(model, DynamicCache(config=model.config), ids, mask, **kw)
    cache = hf.make_cache(model, kv)
    assert torch.equal(_generate(model, cache, ids, mask, **kw), dense)
    assert cache.batch_size == 2 * 2


@pytest.mark.parametrize("sampling", [{"top_k": 1}, {"temperature": 1.0}], ids=["top-k-1", "seeded"])
def test_num_return_sequences_sizes_the_cache(llama, sampling):
    """num_return_sequences = 2 without beams: the cache takes the expanded batch of its first step (it used to
    refuse a batch it was not made for) and samples as DynamicCache does under the same seed."""
    model, codec = llama
    ids, mask = _left_padded(_prompts(12, 7))
    out = []
    for cache in (DynamicCache(config=model.config), hf.make_cache(model, ReadKV(codec, FULL))):
        torch.manual_seed(0)
        out.append(_generate(model, cache, ids, mask, do_sample=True, num_return_sequences=2, **sampling))
    assert out[0].shape == (4, 6)
    assert torch.equal(out[1], out[0])


def test_batch_select_indices(llama):
    """After decoding a padded batch, keeping only its second sequence continues as that prompt alone, and as
    DynamicCache.batch_select_indices does."""
    model, codec = llama
    prompts = _prompts(12, 7)
    ids, mask = _left_padded(prompts)
    follow = torch.tensor([[11, 12, 13], [21, 22, 23]])  # tokens fed after the prompts
    caches = [DynamicCache(config=model.config), hf.make_cache(model, ReadKV(codec, FULL))]
    alone = hf.make_cache(model, ReadKV(codec, FULL))
    _step(model, alone, prompts[1][None], torch.ones(1, 7, dtype=torch.long))
    for cache in caches:
        _step(model, cache, ids, mask)
        _step(model, cache, follow[:, :1], torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
        cache.batch_select_indices(torch.tensor([1]))
    _step(model, alone, follow[1:, :1], torch.ones(1, 8, dtype=torch.long))
    for j in (1, 2):
        tok = follow[1:, j:j + 1]
        padded_mask = torch.cat([mask[1:], torch.ones(1, 1 + j, dtype=torch.long)], 1)  # the row's pads stay masked
        dense, pk = (_step(model, c, tok, padded_mask) for c in caches)
        ref = _step(model, alone, tok, torch.ones(1, 8 + j, dtype=torch.long))
        _close(pk, dense)
        assert torch.allclose(pk, ref, atol=1e-4, rtol=1e-4)
    assert caches[1].batch_size == 1


def test_batch_repeat_interleave(llama):
    """A prompt prefilled once and repeated twice decodes two different continuations as two separate prompts
    would, and as DynamicCache.batch_repeat_interleave does."""
    model, codec = llama
    (p,) = _prompts(10)
    follow = torch.tensor([[31], [41]])
    caches = [DynamicCache(config=model.config), hf.make_cache(model, ReadKV(codec, FULL))]
    for cache in caches:
        _step(model, cache, p[None], torch.ones(1, 10, dtype=torch.long))
        cache.batch_repeat_interleave(2)
    dense, pk = (_step(model, c, follow, torch.ones(2, 11, dtype=torch.long)) for c in caches)
    _close(pk, dense)
    for i in range(2):
        one = hf.make_cache(model, ReadKV(codec, FULL))
        _step(model, one, p[None], torch.ones(1, 10, dtype=torch.long))
        assert torch.allclose(pk[i], _step(model, one, follow[i:i + 1], torch.ones(1, 11, dtype=torch.long))[0],
                              atol=1e-4, rtol=1e-4)


def test_crop_rolls_back_a_padded_batch(llama):
    """crop(-2) after three decode steps of a padded batch: the next steps read as if the two removed tokens
    had never been fed (pages truncated per sequence), as DynamicCache.crop does."""
    model, codec = llama
    ids, mask = _left_padded(_prompts(12, 7))
    ones = torch.ones(2, 1, dtype=torch.long)
    kept, dropped, after = torch.tensor([[11], [21]]), torch.tensor([[12, 13], [22, 23]]), torch.tensor([[14], [24]])
    caches = [DynamicCache(config=model.config), hf.make_cache(model, ReadKV(codec, FULL))]
    never = hf.make_cache(model, ReadKV(codec, FULL))  # never sees the dropped tokens
    for cache in (*caches, never):
        _step(model, cache, ids, mask)
        _step(model, cache, kept, torch.cat([mask, ones], 1))
    for cache in caches:
        for j in range(2):
            _step(model, cache, dropped[:, j:j + 1], torch.cat([mask, ones.repeat(1, 2 + j)], 1))
        cache.crop(-2)
        assert cache.get_seq_length() == 13
    full_mask = torch.cat([mask, ones, ones], 1)
    dense, pk = (_step(model, c, after, full_mask) for c in caches)
    _close(pk, dense)
    assert torch.allclose(pk, _step(model, never, after, full_mask), atol=1e-4, rtol=1e-4)


def test_assisted_decoding_by_prompt_lookup(llama):
    """Prompt-lookup decoding verifies several drafted tokens in one step (each reads the cache up to itself)
    and crops the rejected ones: the greedy tokens of plain dense decoding."""
    model, codec = llama
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8]])
    dense = _generate(model, DynamicCache(config=model.config), ids, new=10)
    cache = hf.make_cache(model, ReadKV(codec, FULL))
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]  # type: ignore[method-assign]
    assert torch.equal(_generate(model, cache, ids, new=10, prompt_lookup_num_tokens=3), dense)
    assert any(n < 0 for n in crops)  # drafted tokens were rejected and rolled back
    assert cache.tally.rows > 2 * len(crops)  # steps of several tokens read once per token


def test_tiered_cache_reads_a_padded_batch_and_refuses_edits(llama):
    """A tiered cache (everything resident) decodes a padded batch as the untiered cache does; reordering,
    selecting, repeating and cropping are refused by name, beam search included."""
    model, codec = llama
    ids, mask = _left_padded(_prompts(12, 7))
    tiering = hf.Tiering(hot=8, max_tokens=64)
    cache = hf.make_cache(model, ReadKV(codec, FULL), tiering=tiering)
    tokens = _generate(model, cache, ids, mask)
    assert torch.equal(tokens, _generate(model, hf.make_cache(model, ReadKV(codec, FULL)), ids, mask))
    assert not cache.is_croppable
    cache.crop(0)  # nothing to remove: allowed
    for name, call in [("reorder_cache", lambda: cache.reorder_cache(torch.tensor([1, 0]))),
                       ("batch_select_indices", lambda: cache.batch_select_indices(torch.tensor([0]))),
                       ("batch_repeat_interleave", lambda: cache.batch_repeat_interleave(2)),
                       ("crop", lambda: cache.crop(-1))]:
        with pytest.raises(NotImplementedError, match=name):
            call()
    with pytest.raises(NotImplementedError, match="reorder_cache"):
        _generate(model, hf.make_cache(model, ReadKV(codec, FULL), tiering=tiering), ids, mask, num_beams=2)


def test_bad_uses_are_refused(llama):
    """Padding after the prompt, a batch the cache does not hold, a positive crop and the old batch_size
    argument each say what is wrong."""
    model, codec = llama
    (p,) = _prompts(6)
    cache = hf.make_cache(model, ReadKV(codec, FULL))
    _step(model, cache, p[None], torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="holds 1 sequences, the step brings 2"):
        _step(model, cache, torch.tensor([[7], [8]]), torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="minus the number of positions"):
        cache.crop(3)
    with pytest.raises(ValueError, match="cannot remove 7 positions"):
        cache.crop(-7)
    padded = hf.make_cache(model, ReadKV(codec, FULL))
    _step(model, padded, p[None], torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="padding after the prompt"):
        _step(model, padded, torch.tensor([[0]]), torch.tensor([[1, 1, 1, 1, 1, 1, 0]]))
    with pytest.warns(DeprecationWarning, match="batch_size"):
        hf.make_cache(model, ReadKV(codec, FULL), batch_size=2)


def test_a_model_without_planekv_attention_is_refused(llama):
    """With another attention implementation the step's K/V would never be written: the next step says so
    (before, decode steps silently attended to their own token only), and a later dense forward of another model
    is not touched by the K/V left waiting."""
    from .conftest import tiny_llama

    model, codec = llama
    other = tiny_llama()
    other.set_attn_implementation("sdpa")
    cache = hf.make_cache(other, ReadKV(codec, FULL))
    (p,) = _prompts(6)
    _step(other, cache, p[None], torch.ones(1, 6, dtype=torch.long))
    with pytest.raises(RuntimeError, match="attention implementation 'planekv'"):
        _step(other, cache, p[None, :1], torch.ones(1, 7, dtype=torch.long))
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        expected = model(p[None], use_cache=False).logits[:, -1]
    assert torch.allclose(_step(model, dense, p[None], torch.ones(1, 6, dtype=torch.long)), expected, atol=1e-5)


def test_tierings_budgets_and_lower_tiers_reach_the_tiered_cache(llama, tmp_path):
    """Tiering's Key page budget, host tier size and spill tier are the TieredCache's: a host tier of 0 bytes
    refuses the first sealed page by name; with room, the cache has Key page slots and the given spill tier."""
    from planekv.tiering import PlacementPolicy, SpillTier, TierFull

    model, codec = llama
    ids = _prompts(150)[0][None]
    spill = SpillTier(tmp_path, 64 << 20, backend="posix")
    placement = PlacementPolicy(hot_planes={"k": 2, "v": 2}, block_bytes=1 << 20)

    def tiering(host_bytes: int) -> hf.Tiering:
        return hf.Tiering(hot=2, max_tokens=200, placement=placement, key_page_bytes=16 << 20,
                          host_bytes=host_bytes, spill=spill)

    cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(4.0)), tiering=tiering(0))
    with pytest.raises(TierFull, match="host tier full"):
        _generate(model, cache, ids, new=3)
    cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(4.0)), tiering=tiering(8 << 20))
    _generate(model, cache, ids, new=3)
    assert cache.pages.key_page_slots(0) > 0 and cache.pages.host.spill is spill
    assert cache.pages.host.capacity_bytes == 8 << 20


def test_prefetch_after_the_dense_prefill_serves_the_first_decode_step(llama) -> None:
    """The first decode step has no step before it to prefetch from: after a dense prefill, a read of the prompt's
    last queries prefetches what they ask for past the hot planes, so that step caps much less than without it;
    the prefill itself is not counted as a read."""
    model, codec = llama
    ids = _prompts(150)[0][None]
    caps = {}
    for warm in (True, False):
        tiering = hf.Tiering(hot=2, max_tokens=200, prefetch_after_prefill=warm)
        cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(4.0)), tiering=tiering)
        _generate(model, cache, ids, new=2)  # the prefill, then one decode step
        tally = cache.tier_tally.summary()
        assert tally["steps"] == len(cache.layers)  # one step of every layer: the prefill's read is not counted
        caps[warm] = tally["cap_rate"]
    assert caps[False] > 0 and caps[True] < 0.25 * caps[False]  # seen: 2.1% against 25%
