"""`planekv bench prefix` on the tiny Llama (CPU): the three rows, whole pages reused, the reused prompt's first token
equal to the fresh compressed prefill's, the JSON written; a tiered run; the dense-codes stand-in above the
compressed limit. Timings are never asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from planekv.bench.prefix import MODES, PrefixConfig, run_prefix  # noqa: E402
from planekv.bench.tiering import policy_named  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames past_key_values

PREFIX, SUFFIX = 200, 8


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, calib_path):
    from planekv.evaluation.common import setup

    return setup(str(tiny_model_dir), calib_path, device="cpu")


def _check(rows, page: int, compressed: bool) -> None:
    assert [r.mode for r in rows] == list(MODES)
    dense, comp, reuse = rows
    assert dense.ttft_ms is not None and dense.ttft_ms > 0 and dense.run == PREFIX + SUFFIX
    assert reuse.reused == (PREFIX // page) * page and reuse.reused > 0  # whole pages of the prefix
    assert reuse.run == PREFIX + SUFFIX - reuse.reused
    assert reuse.ttft_ms is not None and reuse.load_ms is not None and reuse.x_dense is not None
    assert len(reuse.times_ms) == len(dense.times_ms)
    if compressed:
        assert comp.skipped is None and comp.first_token is not None
        assert reuse.index_from == "compressed"
        assert reuse.first_token == comp.first_token and reuse.same_as_compressed is True
        assert reuse.logit_diff is not None and reuse.logit_diff < 1e-4
        assert reuse.x_compressed is not None
    else:
        assert comp.skipped and comp.ttft_ms is None
        assert reuse.index_from == "dense-codes" and reuse.same_as_compressed is None


def test_the_bench_writes_its_rows_and_the_reused_prompt_gives_the_compressed_prefills_first_token(
        tiny, tiny_model_dir, calib_path, tmp_path, capsys) -> None:
    from planekv.cli import main

    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", str(tiny_model_dir), "--calibration", str(calib_path), "--device",
               "cpu", "--tokens", str(PREFIX), "--suffix", str(SUFFIX), "--reps", "2", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["page_size"] == tiny.codec.spec.page_size and doc["meta"]["config"]["reps"] == 2
    assert "ttft_ms" in capsys.readouterr().out
    from planekv.bench.prefix import PrefixRow

    rows = [PrefixRow(**r) for r in doc["rows"]]
    _check(rows, tiny.codec.spec.page_size, compressed=True)
    assert all(len(r.times_ms) == 2 for r in rows if r.ttft_ms is not None)


def test_a_tiered_cache_reuses_whole_pages_too(tiny) -> None:
    cfg = PrefixConfig(prefix_tokens=PREFIX, suffix_tokens=SUFFIX, reps=1, tiered_hot=4, reader="reference")
    rows = run_prefix(tiny.lm.model, tiny.lm.tokenizer, tiny.codec, policy_named("flex-r4"), cfg)
    _check(rows, tiny.codec.spec.page_size, compressed=True)


def test_above_the_compressed_limit_the_index_is_a_dense_prefills_codes_and_the_row_says_why(tiny) -> None:
    cfg = PrefixConfig(prefix_tokens=PREFIX, suffix_tokens=SUFFIX, reps=1, max_compressed_tokens=100)
    lines: list[str] = []
    rows = run_prefix(tiny.lm.model, tiny.lm.tokenizer, tiny.codec, policy_named("flex-r4"), cfg,
                      progress=lines.append)
    _check(rows, tiny.codec.spec.page_size, compressed=False)
    assert "max-compressed-tokens" in rows[1].skipped and any("dense-codes" in s for s in lines)


def test_bad_configs_are_refused() -> None:
    for kw in ({"prefix_tokens": 0}, {"prefix_tokens": 8, "reps": 0}, {"prefix_tokens": 8, "index_from": "x"},
               {"prefix_tokens": 8, "tiered_hot": 9}):
        with pytest.raises(ValueError):
            PrefixConfig(**kw)
