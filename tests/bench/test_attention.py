"""The decode-attention benchmark harness (planekv.bench): its report, its byte counts, reader settings from the
command line, and whole runs at toy sizes through Triton's interpreter (no meaningful times)."""

from __future__ import annotations

import pytest

from planekv.bench import Row, Shape, config_with, format_timeline, parse_settings, run_bench, sector_bytes_v
from planekv.kernels import ReaderConfig


def test_timeline_report_lists_kernels_by_time() -> None:
    row = Row("b32-t32k", "readkv-flex-r2", 1.5, 1.4, 2.0, 1.0, 2.0, 2.0, 1.0,
              {"timeline": {"kernels_us": {"_key_stage_f": [1.0, 731.2], "_prep": [1.0, 31.4]},
                            "kernel_sum_us": 762.6, "graph_us": 780.0}})
    text = format_timeline([row, Row("b32-t32k", "sdpa", 1.0, 1.0, 16.0, 1.0, 1.0, 1.0, 4.0)])
    lines = text.splitlines()
    assert lines[0] == "b32-t32k / readkv-flex-r2: graph 780.0 us per step, kernels 762.6 us"
    assert "_key_stage_f" in lines[1] and "731.20" in lines[1] and "_prep" in lines[2]
    assert len(lines) == 3  # rows without a timeline are left out


def test_physical_value_bytes_follow_the_v_run_layout() -> None:
    """The benchmark's physical Value bytes (32-byte sectors) in the format's layout: with v_run = g a
    token's rows of a run lie together (16-byte rows at d = 128: a token reaching 1-2 planes of a run
    touches one sector, 3-4 two); plane-major, neighbours share a sector in the planes both reach; the
    same depths, two layouts, two counts, against a hand count."""
    import torch

    dep = torch.zeros(1, 1, 64, dtype=torch.int64)
    dep[0, 0, :8] = torch.tensor([1, 0, 0, 2, 4, 4, 0, 3])  # 14 rows = 224 logical bytes
    lengths = torch.tensor([64])
    assert sector_bytes_v(dep, lengths, 128) == 10 * 32  # plane-major: sector pairs reach 1, 2, 4, 3
    # runs of 4: 1 + 1 + 2 + 2 + 2 sectors; runs of 2: planes 0-1 (5 tokens), 2-3 (3 tokens)
    assert sector_bytes_v(dep, lengths, 128, v_run=4, width=8, page=64) == 8 * 32
    assert sector_bytes_v(dep, lengths, 128, v_run=2, width=8, page=64) == 8 * 32
    assert sector_bytes_v(dep, lengths, 128, v_run=8, width=8, page=64) == 8 * 32
    # d = 64 (8-byte rows), runs of 2: one 16-byte run per token and run, two tokens a sector
    assert sector_bytes_v(dep, lengths, 64, v_run=2, width=8, page=64) == (4 + 2) * 32
    assert sector_bytes_v(dep, torch.tensor([4]), 64, v_run=2, width=8, page=64) == (2 + 0) * 32


@pytest.mark.slow
def test_the_attention_benchmark_runs_a_v_run_format() -> None:
    """``planekv bench attention --v-run 4`` end to end at a toy size (the interpreter: no meaningful times):
    the format's cache is encoded in runs of 4 planes, the reader's check against the reference reader finds
    the same depths and output, and the rows carry the requested bits and the layout's physical bytes."""
    rows = run_bench([Shape("toy", 2, 200, 4, 2, 64)], ["sdpa", "readkv-flex-r2"], reps=1, check=True,
                     codebook="uniform-linear-c3", v_run=4)
    sdpa, flex = rows
    assert sdpa.system == "sdpa" and flex.system == "readkv-flex-r2"
    assert flex.check["k_depth_mismatch"] == 0 and flex.check["v_depth_mismatch"] == 0
    assert flex.check["rel_err"] < 1e-5
    assert flex.logical_bits_per_scalar == pytest.approx(2.0, abs=0.05)
    assert 1.0 < flex.physical_over_logical < 10.0


@pytest.mark.slow
def test_the_attention_benchmark_runs_batch_parts() -> None:
    """``planekv bench attention --batch-streams 2`` at a toy size (the interpreter: the parts one after the
    other): the check against the reference reader and the counted bytes are those of the whole batch."""
    rows = {n: run_bench([Shape("toy", 3, 200, 4, 2, 64)], ["readkv-flex-r2"], reps=1, check=True,
                         config=ReaderConfig(batch_streams=n))[0] for n in (1, 2)}
    assert rows[2].check["k_depth_mismatch"] == 0 and rows[2].check["v_depth_mismatch"] == 0
    assert rows[2].check["rel_err"] < 1e-5
    assert rows[2].logical_bits_per_scalar == rows[1].logical_bits_per_scalar
    assert rows[2].physical_bytes == rows[1].physical_bytes


def test_the_attention_benchmark_refuses_fewer_than_one_stream(capsys: pytest.CaptureFixture[str]) -> None:
    from planekv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--batch-streams", "0"])
    assert exc.value.code == 2 and "--batch-streams: must be >= 1, got 0" in capsys.readouterr().err


def test_reader_settings_from_the_command_line() -> None:
    """``--config name=value[,...]`` (the benchmark, ab_config.py, profile_step.py): numbers and bools parsed,
    a ReaderConfig with those fields made; an unknown field or a bad value refused with what to fix."""
    assert parse_settings("num_warps=8,sample_slack=0.5,key_int8=false,assembly=fma") == {
        "num_warps": 8, "sample_slack": 0.5, "key_int8": False, "assembly": "fma"}
    assert parse_settings("") == {}
    cfg = config_with(parse_settings("num_warps=8,key_walk=by-depth"))
    assert cfg == ReaderConfig(num_warps=8, key_walk="by-depth")
    with pytest.raises(ValueError, match="no field \\['nope'\\]"):
        config_with({"nope": 1})
    with pytest.raises(ValueError, match="ReaderConfig.num_warps must be"):
        config_with({"num_warps": 3})
    with pytest.raises(ValueError, match="name=value"):
        parse_settings("num_warps")

