"""The benchmark tools in benchmarks/tools: the linear-codebook distortion table, the launch-floor and L2-fetch
wrappers' argument checks, the Nsight Compute floor report, and the SASS fingerprint's comparison."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

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


def test_fingerprint_comparison_reports_what_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """sass_fingerprint.py --compare: identical launches compare clean (a rename alone is reported as such);
    a different SASS, grid, scalar or pointer argument, or launch count is a difference."""
    mod = _tool("sass_fingerprint", monkeypatch)
    launch = {"kernel": "_a", "grid": [4, 1, 1], "options": {"num_warps": 4}, "scalars": {"T": 64},
              "pointers": {"x_ptr": "plan.logits"}, "sha": "s1", "sha_params": "p1"}
    old = {"case": {"launches": [launch]}}
    assert mod.compare(old, old) == []
    renamed = {"case": {"launches": [launch | {"kernel": "_b"}]}}
    assert mod.compare(renamed, old) == ["renamed (same SASS): _a -> _b"]
    for change, want in ((dict(sha="s2", sha_params="p1"), "SASS differs only in parameter offsets"),
                         (dict(sha="s2", sha_params="p2"), "SASS differs"), (dict(grid=[8, 1, 1]), "grid"),
                         (dict(scalars={"T": 65}), "scalars"),
                         (dict(pointers={"x_ptr": "plan.vimp"}), "pointer x_ptr")):
        diffs = mod.compare({"case": {"launches": [launch | change]}}, old)
        assert len(diffs) == 1 and want in diffs[0], diffs
    assert "2 launches" in mod.compare(old, {"case": {"launches": [launch, launch]}})[0]

