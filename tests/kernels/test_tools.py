"""The kernel-analysis tools behind docs/KERNEL_NOTES.md (runs 35-38): the linear-codebook distortion
table that the floor analysis cites, and the per-kernel timeline's report."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from planekv.kernels.bench import Row, format_timeline
from planekv.kvstore.codebook import GaussianTree

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str, monkeypatch: pytest.MonkeyPatch | None = None):
    """benchmarks/tools/<name>.py as a module (registered in sys.modules for the test where given a
    monkeypatch: a dataclass there resolves its annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


def _linear_codebook():
    return _tool("linear_codebook")


def test_additive_fit_of_the_tree_is_exact_to_depth_2_and_far_off_deeper() -> None:
    """Two planes' four reconstruction values are always a + w0 b0 + w1 b1, so a codebook linear in
    the planes loses nothing there; from depth 3 the tree's centroids are not additive and the
    tails dominate (KERNEL_NOTES: 1.16x at depth 3, 281x at depth 8)."""
    lc = _linear_codebook()
    tree = GaussianTree(8)
    d_tree = tree.distortion[1:]
    d_lin = lc.additive_distortion([-math.inf, *tree.thresholds(8), math.inf])
    ratio = [a / b for a, b in zip(d_lin, d_tree, strict=True)]
    assert abs(ratio[0] - 1) < 1e-9 and abs(ratio[1] - 1) < 1e-9
    assert 1.1 < ratio[2] < 1.25 and ratio[3] > 2 and ratio[7] > 100
    assert all(b >= a for a, b in zip(ratio[1:], ratio[2:], strict=False))  # only worse with depth


def test_named_linear_codebook_is_the_tools_additive_fit_of_uniform_cells() -> None:
    """UniformLinearTree (normal equations over the depth-t cells) and the tool (least squares over
    the 2^W leaves) compute the same distortion for nested uniform cells."""
    from planekv.kvstore import UniformLinearTree

    lc = _linear_codebook()
    for clip in (3.0, 3.5):
        edges = [-math.inf, *[-clip + 2 * clip * i / 256 for i in range(1, 256)], math.inf]
        tool = lc.additive_distortion(edges)
        assert UniformLinearTree(8, clip).distortion[1:] == pytest.approx(tool, rel=1e-9)


def test_timeline_report_lists_kernels_by_time() -> None:
    row = Row("b32-t32k", "readkv-flex-r2", 1.5, 1.4, 2.0, 1.0, 2.0, 2.0, 1.0,
              {"timeline": {"kernels_us": {"_key_stage_f": [1.0, 731.2], "_prep": [1.0, 31.4]},
                            "kernel_sum_us": 762.6, "graph_us": 780.0}})
    text = format_timeline([row, Row("b32-t32k", "sdpa", 1.0, 1.0, 16.0, 1.0, 1.0, 1.0, 4.0)])
    lines = text.splitlines()
    assert lines[0] == "b32-t32k / readkv-flex-r2: graph 780.0 us per step, kernels 762.6 us"
    assert "_key_stage_f" in lines[1] and "731.20" in lines[1] and "_prep" in lines[2]
    assert len(lines) == 3  # rows without a timeline are left out


def test_word_reads_round_each_word_up_to_its_deepest_channel() -> None:
    """The token-major layout study (KERNEL_NOTES, the binary-MMA plan): a word of channels is read to
    its deepest channel's depth, so mixing depths in a word costs bits and sorting by depth saves them."""
    mod = _tool("key_word_reads")
    import torch

    dep = torch.tensor([[8, 0, 0, 0, 1, 1, 1, 1]])
    assert mod.word_cost(dep, torch.arange(8)[None], word=4) == 4 * 8 + 4 * 1
    assert mod.word_cost(dep, dep.argsort(-1, descending=True), word=4) == 4 * 8 + 4 * 1
    mixed = torch.tensor([[8, 0, 1, 0, 1, 0, 1, 1]])
    assert mod.word_cost(mixed, torch.arange(8)[None], word=4) == 4 * 8 + 4 * 1
    assert mod.word_cost(mixed, torch.tensor([[0, 2, 4, 6, 1, 3, 5, 7]]), word=4) == 4 * 8 + 4 * 1
    assert mod.word_cost(mixed, torch.tensor([[1, 3, 5, 6, 0, 2, 4, 7]]), word=4) == 4 * 1 + 4 * 8
    assert mod.word_cost(mixed, torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]]), word=2) == 2 * (8 + 1 + 1 + 1)


def test_layout_bytes_count_the_granules_each_layout_touches() -> None:
    """value_layout_bytes.py (KERNEL_NOTES run 67): plane-major Value rows (16 bytes at d = 128) share a
    granule with their neighbours only in the planes both reach; token-major rows keep a token's
    planes together; Key planes are counted per page and granule of channels."""
    mod = _tool("value_layout_bytes")
    import torch

    dep = torch.tensor([[[1, 0, 0, 2, 4, 4, 0, 3]]])  # one head, 8 tokens, logical 14 rows = 224 bytes
    # 32-byte granules hold 2 tokens: planes reached 1, 2, 4, 3 -> 10 granules
    assert mod.value_plane_major(dep, 16, 32, 8) == 10 * 32
    assert mod.value_plane_major(dep, 16, 64, 8) == (2 + 4) * 64  # 4 tokens a granule: max 2, max 4
    # token-major: a token's first s rows, ceil(16 s / g) granules
    assert mod.value_token_major(dep, 16, 32, 8) == (1 + 1 + 2 + 2 + 2) * 32
    assert mod.value_token_major(dep, 16, 128, 8) == 5 * 128
    assert mod.value_plane_major(dep, 16, 16, 8) == 14 * 16  # row-sized granules: the logical bytes
    kdep = torch.tensor([[[3, 0, 0, 0, 1, 1, 1, 1]]])  # 8 channels, 64-token pages: 8-byte rows
    assert mod.key_plane_major(kdep, torch.tensor([2.0]), 64, 32) == 2 * (3 + 1) * 32  # 4 channels a granule


def test_physical_value_bytes_follow_the_v_run_layout() -> None:
    """The benchmark's physical Value bytes (32-byte sectors) in the format's layout: with v_run = g a
    token's rows of a run lie together (16-byte rows at d = 128: a token reaching 1-2 planes of a run
    touches one sector, 3-4 two); plane-major, neighbours share a sector in the planes both reach; the
    same depths, two layouts, two counts, against a hand count."""
    import torch

    from planekv.kernels.bench import _sector_bytes_v

    dep = torch.zeros(1, 1, 64, dtype=torch.int64)
    dep[0, 0, :8] = torch.tensor([1, 0, 0, 2, 4, 4, 0, 3])  # 14 rows = 224 logical bytes
    lengths = torch.tensor([64])
    assert _sector_bytes_v(dep, lengths, 128) == 10 * 32  # plane-major: sector pairs reach 1, 2, 4, 3
    # runs of 4: 1 + 1 + 2 + 2 + 2 sectors; runs of 2: planes 0-1 (5 tokens), 2-3 (3 tokens)
    assert _sector_bytes_v(dep, lengths, 128, v_run=4, width=8, page=64) == 8 * 32
    assert _sector_bytes_v(dep, lengths, 128, v_run=2, width=8, page=64) == 8 * 32
    assert _sector_bytes_v(dep, lengths, 128, v_run=8, width=8, page=64) == 8 * 32
    # d = 64 (8-byte rows), runs of 2: one 16-byte run per token and run, two tokens a sector
    assert _sector_bytes_v(dep, lengths, 64, v_run=2, width=8, page=64) == (4 + 2) * 32
    assert _sector_bytes_v(dep, torch.tensor([4]), 64, v_run=2, width=8, page=64) == (2 + 0) * 32


def test_reader_settings_of_the_tools() -> None:
    """ab_knobs.py / profile_step.py's ``--set name=value[,...]``: numbers parsed, unknown names refused."""
    from planekv.kernels import TritonReader
    from planekv.kernels.bench import apply_settings, parse_settings
    from planekv.kvstore import Codec
    from planekv.kvstore.synthetic import make_synthetic

    assert parse_settings("key_loop=1,value_bits=shifted,x=0.5") == {"key_loop": 1, "value_bits": "shifted", "x": 0.5}
    assert parse_settings("") == {}
    syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, seed=3)
    reader = TritonReader(Codec(syn.spec, syn.calibration))
    apply_settings(reader, parse_settings("hist_window=128,value_bits=shifted"))
    assert reader.hist_window == 128 and reader.value_bits == "shifted"
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        apply_settings(reader, {"nope": 1})


def test_launch_floor_tool_refuses_without_a_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks/tools/launch_floor.py (KERNEL_NOTES run 101) times CUDA graphs: on a machine without a
    GPU it stops with a message instead of a traceback, and it refuses counts below one."""
    mod = _tool("launch_floor")
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["launch_floor.py", "--json", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit, match="needs a GPU"):
        mod.main()
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("sys.argv", ["launch_floor.py", "--chain", "0"])
    with pytest.raises(SystemExit, match="positive counts"):
        mod.main()
    assert not (tmp_path / "out.json").exists()


def test_launch_floor_takes_only_known_pdl_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pdl`` (KERNEL_NOTES run 108) takes the levels 0, 1 and 2 only."""
    mod = _tool("launch_floor")
    monkeypatch.setattr("sys.argv", ["launch_floor.py", "--pdl", "3"])
    with pytest.raises(SystemExit):
        mod.main()


def test_l2_fetch_wrapper_checks_its_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """benchmarks/tools/with_l2_fetch.py (KERNEL_NOTES run 110) takes 0-128 bytes or 'none' and a script,
    and stops with a message on a machine without a GPU, before running the script."""
    mod = _tool("with_l2_fetch")
    script = tmp_path / "s.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    for argv, msg in ((["w.py", "32"], "usage"), (["w.py", "256", str(script)], "0-128"),
                      (["w.py", "x", str(script)], "0-128")):
        monkeypatch.setattr("sys.argv", argv)
        with pytest.raises(SystemExit, match=msg):
            mod.main()
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["w.py", "32", str(script)])
    with pytest.raises(SystemExit, match="needs a GPU"):
        mod.main()
    assert not (tmp_path / "s.py.ran").exists()


def _ncu_csv(steps: list[list[tuple[str, float, float, float, float]]]) -> str:
    """An ncu --csv text: a banner line, then one row per (launch, metric) as Nsight Compute prints them."""
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows, i = ["==PROF== Connected to process 1", head], 0
    for step in steps:
        for name, us, inst, rd, wr in step:
            for metric, unit, v in (("gpu__time_duration.sum", "us", us), ("smsp__inst_executed.sum", "inst", inst),
                                    ("dram__bytes_read.sum", "MB", rd), ("dram__bytes_write.sum", "MB", wr)):
                rows.append(f'"{i}","{name}","{metric}","{unit}","{v:,}"')
            i += 1
    return "\n".join(rows) + "\n"


def test_ncu_floors_sums_the_last_step_per_kernel(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/tools/ncu_floors.py (KERNEL_NOTES run 101): the profiled step is the last period of the
    launch sequence (from the anchor's launches), a kernel's launches are summed, and each floor is its
    instructions at one per scheduler and cycle or its bytes at the given bandwidth."""
    mod = _tool("ncu_floors", monkeypatch)
    setup = [("fill", 1.0, 10.0, 0.0, 1.0)]
    step = [("copy", 2.0, 5.0, 0.1, 0.0), ("_prep", 20.0, 1056.0, 0.0, 0.0), ("_radix", 3.0, 10.0, 0.0, 0.0),
            ("_radix", 4.0, 10.0, 0.0, 0.0), ("_stage", 100.0, 1056.0e3, 420.0, 0.0)]
    warm = [(n, 10 * us, i, r, w) for n, us, i, r, w in step]  # the warm-up step: other times, same launches
    f = tmp_path / "step.csv"
    f.write_text(_ncu_csv([setup, warm, step]))
    ks = mod.floors(mod.last_step(mod.read_launches(f.read_text()), "_prep"))
    assert [(k.name, k.launches) for k in ks] == [("copy", 1), ("_prep", 1), ("_radix", 2), ("_stage", 1)]
    assert ks[2].us == pytest.approx(7.0) and ks[3].read == pytest.approx(420e6)
    assert mod.main([str(f), "--sms", "1", "--clock-ghz", "1.0", "--dram-tbps", "4.2"]) == 0
    out = capsys.readouterr().out
    # _stage: 1.056e6 instructions at 4 per ns -> 264 us; 420 MB at 4.2 TB/s -> 100 us; the sum of the
    # larger floors: copy 0.024 (its 0.1 MB) + _prep 0.264 + _radix 0.005 + _stage 264
    assert "| _stage | 1 | 100.0 | 264.0 | 420.0 / 0.0 | 100.0 |" in out
    assert "step 129.0 us" in out and "max(instr., DRAM) 264.3 us" in out
    f.write_text(_ncu_csv([step]))
    with pytest.raises(SystemExit, match="profile a warm-up step"):
        mod.main([str(f)])


def test_the_attention_benchmark_runs_a_v_run_format() -> None:
    """``planekv bench attention --v-run 4`` end to end at a toy size (the interpreter: no meaningful times):
    the format's cache is encoded in runs of 4 planes, the reader's check against the reference reader finds
    the same depths and output, and the rows carry the requested bits and the layout's physical bytes."""
    from planekv.kernels.bench import Shape, run_bench

    rows = run_bench([Shape("toy", 2, 200, 4, 2, 64)], ["sdpa", "readkv-flex-r2"], reps=1, check=True,
                     codebook="uniform-linear-c3", v_run=4)
    sdpa, flex = rows
    assert sdpa.system == "sdpa" and flex.system == "readkv-flex-r2"
    assert flex.check["k_depth_mismatch"] == 0 and flex.check["v_depth_mismatch"] == 0
    assert flex.check["rel_err"] < 1e-5
    assert flex.logical_bits_per_scalar == pytest.approx(2.0, abs=0.05)
    assert 1.0 < flex.physical_over_logical < 10.0


def test_the_attention_benchmark_runs_batch_parts() -> None:
    """``planekv bench attention --batch-streams 2`` at a toy size (the interpreter: the parts one after the
    other): the check against the reference reader and the counted bytes are those of the whole batch."""
    from planekv.kernels.bench import Shape, run_bench

    rows = {n: run_bench([Shape("toy", 3, 200, 4, 2, 64)], ["readkv-flex-r2"], reps=1, check=True,
                         batch_streams=n)[0] for n in (1, 2)}
    assert rows[2].check["k_depth_mismatch"] == 0 and rows[2].check["v_depth_mismatch"] == 0
    assert rows[2].check["rel_err"] < 1e-5
    assert rows[2].logical_bits_per_scalar == rows[1].logical_bits_per_scalar
    assert rows[2].physical_bytes == rows[1].physical_bytes


def test_the_attention_benchmark_refuses_fewer_than_one_stream(capsys: pytest.CaptureFixture[str]) -> None:
    from planekv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--batch-streams", "0"])
    assert exc.value.code == 2 and "--batch-streams: must be >= 1, got 0" in capsys.readouterr().err
