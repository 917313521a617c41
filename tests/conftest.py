"""Suite-wide: without a GPU, Triton kernels run in Triton's interpreter (the variable must be set before any
test module imports planekv.kernels: triton.jit reads it at decoration time); with several pytest-xdist workers
each one's torch (and the processes it starts) uses its share of the cores, not all of them (two workers with two
threads each on two cores ran the decode-step tests ten times slower); tests marked ``slow`` are collected first,
so that with one worker per core (``make test``) the long ones start early and the workers finish together."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # the services, jobs and workers tests start


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first, order kept


def build_tiny_model_dir(path: Path) -> Path:
    """A tiny local model directory (random Llama with GQA + a byte-level BPE tokenizer trained here on a slice
    of a shipped text), so the jobs and workers run end to end in seconds, offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from planekv.evaluation.texts import load_text

    text = load_text("emma")[:200_000]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama and its tokenizer, saved as a local HF directory (build_tiny_model_dir)."""
    pytest.importorskip("transformers")
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def calib_path(tiny_model_dir, tmp_path_factory) -> Path:
    """A calibration artifact of the tiny model (512 tokens), made once per session."""
    from planekv.evaluation import calibrate

    out = tmp_path_factory.mktemp("calib")
    assert calibrate.main(["--model", str(tiny_model_dir), "--max-tokens", "512", "--window", "256",
                           "--out", str(out), "--no-register", "--device", "cpu"]) == 0
    (path,) = out.glob("calibration-*.pt")
    return path
