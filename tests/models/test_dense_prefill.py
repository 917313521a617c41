"""The dense prefill of a ``planekv``-attention model stays linear in the prompt: an unpadded causal prefill reaches
SDPA with no materialized mask (``is_causal``), and a grouped-query prefill whose K/V heads are repeated for SDPA
(what ``planekv_attention`` does on CUDA in float32, where ``enable_gqa`` would fall back to PyTorch's math kernel
and its [B, Hq, S, S] scores) gives transformers' own outputs, unpadded and left-padded."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from planekv.kvstore import ReadPolicy  # noqa: E402
from planekv.kvstore.reference import ReadKV  # noqa: E402
from planekv.models import hf  # noqa: E402

from .conftest import VOCAB  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values


def _sdpa_calls(monkeypatch) -> list[dict]:
    """Record what every torch SDPA call gets (head counts, mask, is_causal, enable_gqa)."""
    calls: list[dict] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append({"hq": q.shape[1], "hkv": k.shape[1], "mask": None if attn_mask is None else
                      (attn_mask.dtype, tuple(attn_mask.shape)), "is_causal": is_causal, "enable_gqa": enable_gqa})
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _ids(n: int, batch: int = 1, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


def test_an_unpadded_prefill_with_a_planekv_cache_reaches_sdpa_causal_without_a_mask(llama, monkeypatch) -> None:
    model, codec = llama
    calls = _sdpa_calls(monkeypatch)
    cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(8.0)))
    with torch.no_grad():
        model(_ids(96), past_key_values=cache, use_cache=True, logits_to_keep=1)
    assert len(calls) == 2  # one per layer
    assert all(c["mask"] is None and c["is_causal"] for c in calls)


def test_the_gqa_expansion_is_asked_for_a_float32_cuda_prefill_only() -> None:
    q, k = torch.zeros(1, 9, 8, 4), torch.zeros(1, 3, 8, 4)
    assert not hf._expand_gqa_for_sdpa(q, k, None)  # CPU: transformers' enable_gqa runs a fused kernel there
    if torch.cuda.is_available():
        qc, kc = q.cuda(), k.cuda()
        assert hf._expand_gqa_for_sdpa(qc, kc, None)
        assert not hf._expand_gqa_for_sdpa(qc.half(), kc.half(), None)  # flash takes grouped K/V in half precision
        assert not hf._expand_gqa_for_sdpa(qc[:, :, :1], kc, None)  # a decode step: one query
        assert not hf._expand_gqa_for_sdpa(qc, kc, torch.ones(1, 1, 8, 8, dtype=torch.bool, device="cuda"))
        assert not hf._expand_gqa_for_sdpa(qc, qc, None)  # no grouping


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_repeating_the_kv_heads_for_sdpa_gives_transformers_outputs(llama, monkeypatch, padded: bool) -> None:
    """The expansion forced on the CPU (as on CUDA in float32): the same logits as transformers' grouped call, with
    and without a PlaneKV cache, and the same codes in the cache; left-padded batches keep their mask."""
    model, codec = llama
    ids = _ids(80, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :17] = 0
        ids[0, :17] = 0

    def run() -> tuple[torch.Tensor, torch.Tensor, hf.PlaneKVHFCache]:
        cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(8.0)))
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            plain = model(ids, attention_mask=mask, position_ids=pos).logits
            cached = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits
        return plain, cached, cache

    plain, cached, cache = run()
    calls = _sdpa_calls(monkeypatch)
    monkeypatch.setattr(hf, "_expand_gqa_for_sdpa", lambda q, k, m: m is None and q.shape[2] > 1)
    plain_x, cached_x, cache_x = run()
    if padded:  # a padded batch keeps its boolean mask: transformers repeats the heads itself
        assert all(c["mask"] is not None and c["mask"][0] == torch.bool for c in calls)
    else:  # the heads arrive repeated, causal, no mask
        assert all(c["hq"] == c["hkv"] and c["mask"] is None and c["is_causal"] for c in calls)
    keep = mask.bool()
    torch.testing.assert_close(plain_x[keep], plain[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached_x[keep], cached[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached[keep], plain[keep], rtol=1e-5, atol=1e-5)  # a dense prefill: SDPA's logits
    assert torch.equal(cached_x[:, -1].argmax(-1), cached[:, -1].argmax(-1))
    assert cache_x.pages is not None and cache.pages is not None
    for layer in range(len(cache.layers)):
        for b in range(ids.shape[0]):
            assert cache_x.pages.length(layer, b) == cache.pages.length(layer, b) == int(mask[b].sum())
            w = codec.spec.width
            assert torch.equal(cache_x.pages.read_k(layer, b, w), cache.pages.read_k(layer, b, w))
            assert torch.equal(cache_x.pages.read_v(layer, b, w), cache.pages.read_v(layer, b, w))
