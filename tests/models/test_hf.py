"""The transformers integration: generate() through the PlaneKV cache, decode logits at full
budget, teacher-forced reads, sliding windows and the query scale of Gemma3, the reader table."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from planekv.kvstore import ReadPolicy, reference  # noqa: E402
from planekv.kvstore.reference import ReadKV, make_system  # noqa: E402
from planekv.models import hf  # noqa: E402

VOCAB = 97  # the tiny models of conftest.py

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values


def _prompt(n: int = 40, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _decode_logits(model, cache, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill ids, then feed ids' continuation token by token; the logits of every decode step."""
    out = []
    with torch.no_grad():
        model(ids[:, :-steps], past_key_values=cache, use_cache=True)
        for i in range(steps, 0, -1):
            tok = ids[:, -i:][:, :1]
            out.append(model(tok, past_key_values=cache, use_cache=True).logits[0, -1])
    return out


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_generate_runs_through_planekv(which, request):
    model, codec = request.getfixturevalue(which)
    ids = _prompt(24)
    cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(2.0)))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, min_new_tokens=6,
                             pad_token_id=0)
    assert out.shape == (1, 30)
    assert cache.pages is not None and cache.pages.length(0, 0) == 29  # prompt + 5 decoded steps stored
    # every decode step of every layer read the compressed cache at R = 2
    assert cache.tally.rows == 5 * 2
    assert cache.tally.bits_per_scalar == pytest.approx(2.0, abs=0.05)


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_full_budget_decode_matches_dense(which, request):
    """At R = W = 8 the reader reads every plane: its decode logits are those of the 8-bit tree code
    read fully (FullReader), close to dense, and closer than at R = 1."""
    model, codec = request.getfixturevalue(which)
    ids = _prompt(40)
    dense = _decode_logits(model, DynamicCache(config=model.config), ids, 4)
    pk = _decode_logits(model, hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(8.0))), ids, 4)
    full = _decode_logits(model, hf.make_cache(model, reference.FullReader(codec, 8)), ids, 4)
    low = _decode_logits(model, hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(1.0))), ids, 4)
    tol = {"llama": 1e-2, "gemma": 5e-2}[which]  # the random Gemma3 amplifies 8-bit code errors more
    for d, p, f, lo in zip(dense, pk, full, low, strict=True):
        err = float((p - d).norm() / d.norm())
        assert torch.allclose(p, f, atol=1e-4, rtol=1e-4)
        assert err < tol
        assert float((lo - d).norm() / d.norm()) > err  # a smaller budget is visibly coarser


@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_baseline_decode_matches_dense(which, request):
    model, codec = request.getfixturevalue(which)
    ids = _prompt(40)
    dense = _decode_logits(model, DynamicCache(config=model.config), ids, 3)
    fp16 = _decode_logits(model, hf.make_cache(model, make_system("dense", 16)), ids, 3)
    for d, p in zip(dense, fp16, strict=True):
        assert float((p - d).norm() / d.norm()) < 1e-3


def test_teacher_forced_dense_equals_model_loss(llama):
    model, _ = llama
    ids = _prompt(64)
    with torch.no_grad():
        loss = model(ids, labels=ids, use_cache=False).loss
        with hf.teacher_forced(make_system("dense", 16)) as tally:
            logits = model(ids, use_cache=False).logits
    tf = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert float(tf) == pytest.approx(float(loss), rel=1e-4)
    assert tally.read_fraction == pytest.approx(1.0)
    assert tally.rows == 2 * 64


def test_teacher_forced_reads_at_the_budget(llama):
    """Every position of every layer reads its own compressed prefix at R: R = 8 is close to dense,
    R = 2 reads 2 bits per scalar and is coarser."""
    model, codec = llama
    ids = _prompt(48)
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits[0]
        out = {}
        for r in (8.0, 2.0):
            with hf.teacher_forced(ReadKV(codec, ReadPolicy.flexible(r)), row_chunk=16) as tally:
                out[r] = (model(ids, use_cache=False).logits[0], tally)
    err = {r: float((x - dense).norm() / dense.norm()) for r, (x, _) in out.items()}
    assert err[8.0] < 1e-2 < err[2.0]
    assert out[2.0][1].bits_per_scalar == pytest.approx(2.0, abs=0.1)
    assert out[2.0][1].rows == 2 * 48


def test_gemma_scale_and_window_are_used(gemma):
    model, codec = gemma
    geo = hf.geometry(model)
    assert geo.sliding_windows == (8, None)
    attn = hf._attention_modules(model)[0]
    assert attn.scaling == pytest.approx(24 ** -0.5)
    # Teacher-forced dense through PlaneKV's path equals the model's own (windowed, scaled) attention.
    ids = _prompt(40)
    with torch.no_grad():
        loss = model(ids, labels=ids, use_cache=False).loss
        with hf.teacher_forced(make_system("dense", 16)):
            logits = model(ids, use_cache=False).logits
    tf = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    assert float(tf) == pytest.approx(float(loss), rel=1e-3)


def test_reader_table():
    assert hf.get_reader("reference") is reference.readkv_decode
    with pytest.raises(ValueError, match="unknown reader"):
        hf.get_reader("nonexistent")


def test_reference_only_options_refuse_other_readers(llama):
    """The kernels do not implement key_variance_correction, sink_keys, single_token_values or
    key_refine in blocks: a cache that would send such a policy to them refuses it instead of
    silently reading without the option."""
    model, codec = llama
    for kw in ({"key_variance_correction": True}, {"sink_keys": 1}, {"single_token_values": True},
               {"key_refine": 0.3, "key_refine_block": 16}):
        pol = ReadPolicy.flexible(2.0, **kw)
        with pytest.raises(ValueError, match="reference reader only"):
            hf.make_cache(model, ReadKV(codec, pol), reader="triton")
        assert hf.make_cache(model, ReadKV(codec, pol)).reader is reference.readkv_decode
    assert ReadPolicy.flexible(2.0).reference_only_options() == []


@pytest.mark.parametrize("pol", [ReadPolicy.flexible(3.0), ReadPolicy.flexible(3.0, key_refine=0.3)],
                         ids=["two-stage", "key-refine"])
def test_triton_reader_decodes_like_the_reference(gemma, pol):
    """reader="triton" (the kernels, through Triton's interpreter without a GPU) gives the decode
    logits of the reference reader, with and without the Key-refinement stage; Gemma3's
    full-attention layer goes through it (head_dim 32)."""
    model, codec = gemma
    ids = _prompt(40)
    ref = _decode_logits(model, hf.make_cache(model, ReadKV(codec, pol)), ids, 3)
    tri_cache = hf.make_cache(model, ReadKV(codec, pol), reader="triton")
    tri = _decode_logits(model, tri_cache, ids, 3)
    for r, t in zip(ref, tri, strict=True):
        assert float((t - r).norm() / r.norm()) < 1e-4
    if pol.key_refine:  # refinement buys whole tokens, so a short row leaves part of its budget unspent
        assert 2.8 <= tri_cache.tally.bits_per_scalar <= 3.0
    else:
        assert tri_cache.tally.bits_per_scalar == pytest.approx(3.0, abs=0.05)
    from planekv.kernels.reader import _READERS

    assert any(r.policy == pol for r in _READERS.values())  # the kernels really ran


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_decode_through_planekv(arch):
    """Qwen2 (biased q/k/v projections) and Mistral (sliding-window config) decode with PlaneKV
    through the same attention hook: generate() runs and every decode step reads the cache."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from .conftest import VOCAB, codec_for

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    else:
        model = MistralForCausalLM(MistralConfig(**common, head_dim=16, sliding_window=None)).eval()
    hf.use_planekv_attention(model)
    codec = codec_for(model, 128)
    ids = _prompt(24)
    cache = hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(4.0)))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, min_new_tokens=4,
                             pad_token_id=0)
    assert out.shape == (1, 28)
    assert cache.tally.rows == 3 * 2  # 3 decode steps x 2 layers read the compressed cache
    assert cache.tally.bits_per_scalar == pytest.approx(4.0, abs=0.05)
    dense = _decode_logits(model, DynamicCache(config=model.config), ids, 3)
    full = _decode_logits(model, hf.make_cache(model, ReadKV(codec, ReadPolicy.flexible(8.0))), ids, 3)
    for d, f in zip(dense, full, strict=True):
        assert float((f - d).norm() / d.norm()) < 2e-2


def test_triton_reads_a_step_of_several_tokens_as_causal_rows(gemma, monkeypatch):
    """With the Triton reader a step of several tokens (here a compressed prefill of 9 tokens, then a step of 3)
    is stored whole and read as causal rows in one run (``TritonReader.decode_rows``): the logits of the
    token-by-token reads (``row_reads`` off) to float32 rounding, at the same logical read (Gemma3's full-attention
    layer; its sliding-window layers read rows through the reference)."""
    from planekv.kernels import TritonReader

    model, codec = gemma
    pol = ReadPolicy.flexible(3.0)
    ids = _prompt(12)
    runs = []
    decode_rows = TritonReader.decode_rows
    monkeypatch.setattr(TritonReader, "decode_rows", lambda self, q, *a, **k: runs.append(q.shape[2]) or
                        decode_rows(self, q, *a, **k))
    logits, tallies = [], []
    for rows in (True, False):
        cache = hf.make_cache(model, ReadKV(codec, pol), reader="triton", dense_prefill=False)
        cache.row_reads = rows
        with torch.no_grad():
            first = model(ids[:, :9], past_key_values=cache, use_cache=True).logits[0]
            step = model(ids[:, 9:], past_key_values=cache, use_cache=True).logits[0]
        logits.append(torch.cat([first, step]))
        tallies.append(cache.tally.bits_per_scalar)
    rows_out, tokens_out = logits
    assert runs == [9, 3]  # the full-attention layer: one run of rows a step
    assert float((rows_out - tokens_out).norm() / tokens_out.norm()) < 1e-4
    assert tallies[0] == pytest.approx(tallies[1], rel=1e-6)
    assert hf.prefix_producer(cache) != hf.prefix_producer(hf.make_cache(model, ReadKV(codec, pol), reader="triton",
                                                                         dense_prefill=False))


def test_triton_row_reads_refuse_rows_past_the_stored_tokens(gemma):
    """A row asking for more tokens than its sequence stores (or none) is refused, naming the stored lengths."""
    from planekv.kernels import TritonReader
    from planekv.kvstore import PlaneKVCache

    model, codec = gemma
    cache = PlaneKVCache(codec.spec, 1)
    k = torch.randn(codec.spec.n_kv_heads, 8, codec.spec.head_dim)
    cache.append(0, codec.encode_k(k, 0), codec.encode_v(k, 0), seq=0)
    q = torch.randn(1, codec.spec.n_q_heads, 2, codec.spec.head_dim)
    reader = TritonReader(codec, ReadPolicy.flexible(3.0))
    with pytest.raises(ValueError, match="row lengths must lie in 1..the tokens stored"):
        reader.decode_rows(q, cache, 0, torch.tensor([[8, 9]]))
    with pytest.raises(ValueError, match="rows must be"):
        reader.decode_rows(q, cache, 0, torch.tensor([[8]]))
