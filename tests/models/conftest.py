"""Tiny random models built locally (no weights downloaded): a GQA Llama and a Gemma3 with
sliding windows, each with a calibration computed on random token windows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from planekv.evaluation.calibrate import calibrate_windows  # noqa: E402
from planekv.kvstore import Codec  # noqa: E402
from planekv.models.hf import format_spec, use_planekv_attention  # noqa: E402

VOCAB = 97


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      rope_theta=10000.0, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    use_planekv_attention(m)
    return m


def tiny_gemma3() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                           sliding_window=8, query_pre_attn_scalar=24, layer_types=["sliding_attention",
                                                                                     "full_attention"])
    m = Gemma3ForCausalLM(cfg).eval()
    use_planekv_attention(m)
    return m


def codec_for(model: torch.nn.Module, n_tokens: int = 256) -> Codec:
    g = torch.Generator().manual_seed(1)
    wins = [torch.randint(0, VOCAB, (n_tokens,), generator=g) for _ in range(2)]
    calib = calibrate_windows(model, wins, model_id="tiny")
    return Codec(format_spec(model, calib, "tiny"), calib)


@pytest.fixture(scope="session")
def llama() -> tuple[torch.nn.Module, Codec]:
    m = tiny_llama()
    return m, codec_for(m)


@pytest.fixture(scope="session")
def gemma() -> tuple[torch.nn.Module, Codec]:
    m = tiny_gemma3()
    return m, codec_for(m)
