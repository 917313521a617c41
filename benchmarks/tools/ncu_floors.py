"""Every kernel of one decode step against its own two floors, from an Nsight Compute CSV.

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,smsp__inst_executed.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread \
        python benchmarks/tools/profile_step.py --shape b32-t32k --system readkv-flex-r2 > step.csv
    python benchmarks/tools/ncu_floors.py step.csv

profile_step.py runs a warm-up step and then the profiled one, so the launch sequence repeats: its
period is the distance between the first and the last launch of ``--anchor`` (``_prep``, once per
step), and the profiled step is the last ``period`` launches. Per kernel name (launches summed): time,
warp instructions and their floor at one instruction per scheduler and cycle, DRAM bytes and their
floor at ``--dram-tbps``, and the sum over kernels of the larger floor (each kernel at its own
roofline). docs/KERNEL_NOTES.md run 101.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from dataclasses import dataclass

METRICS = ("gpu__time_duration.sum", "smsp__inst_executed.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "byte": 1.0, "B": 1.0, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9,
         "inst": 1.0, "": 1.0}


@dataclass
class Kernel:
    name: str
    launches: int = 0
    us: float = 0.0
    inst: float = 0.0
    read: float = 0.0
    written: float = 0.0


def _value(row: dict[str, str]) -> float:
    unit = row["Metric Unit"]
    if unit not in SCALE:
        raise ValueError(f"unknown unit {unit!r} for {row['Metric Name']}")
    return float(row["Metric Value"].replace(",", "")) * SCALE[unit]


def read_launches(text: str) -> list[tuple[str, dict[str, float]]]:
    """The CSV's launches in order: (kernel name, {metric: value in us / instructions / bytes})."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    except StopIteration:
        raise ValueError("no ncu CSV table (a line starting with \"ID\") in the input") from None
    launches: dict[int, tuple[str, dict[str, float]]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        name, metrics = launches.setdefault(int(row["ID"]), (row["Kernel Name"], {}))
        if row["Metric Name"] in METRICS:
            metrics[row["Metric Name"]] = _value(row)
    return [launches[k] for k in sorted(launches)]


def last_step(launches: list[tuple[str, dict[str, float]]], anchor: str) -> list[tuple[str, dict[str, float]]]:
    """The last period of the launch sequence, the period found from the anchor kernel's launches."""
    at = [i for i, (name, _) in enumerate(launches) if name.split("(")[0].split("<")[0].strip() == anchor]
    if len(at) < 2:
        raise ValueError(f"{anchor} launched {len(at)} time(s): profile a warm-up step and at least one more")
    period = at[-1] - at[-2]
    return launches[len(launches) - period:]


def floors(step: list[tuple[str, dict[str, float]]]) -> list[Kernel]:
    """Per kernel name, in order of first launch, the step's sums."""
    out: dict[str, Kernel] = {}
    for name, m in step:
        missing = [k for k in METRICS if k not in m]
        if missing:
            raise ValueError(f"{name[:40]}: metrics {missing} missing from the CSV")
        k = out.setdefault(name, Kernel(name))
        k.launches += 1
        k.us += m["gpu__time_duration.sum"]
        k.inst += m["smsp__inst_executed.sum"]
        k.read += m["dram__bytes_read.sum"]
        k.written += m["dram__bytes_write.sum"]
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --csv output ('-': standard input)")
    ap.add_argument("--anchor", default="_prep", help="a kernel launched once per step")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--dram-tbps", type=float, default=4.2, help="DRAM floor (4.2: the H200's measured copy)")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if args.csv == "-" else open(args.csv).read()
    try:
        kernels = floors(last_step(read_launches(text), args.anchor))
    except ValueError as exc:
        raise SystemExit(f"ncu_floors: {exc}") from None
    issue = args.sms * 4 * args.clock_ghz * 1e3  # warp instructions per us at one per scheduler and cycle
    dram = args.dram_tbps * 1e6  # bytes per us
    print("| kernel | launches | us | instr. floor us | DRAM MB read / written | DRAM floor us |")
    print("|---|---|---|---|---|---|")
    tot = roof = 0.0
    for k in kernels:
        fi, fd = k.inst / issue, (k.read + k.written) / dram
        tot += k.us
        roof += max(fi, fd)
        print(f"| {k.name[:40]} | {k.launches} | {k.us:.1f} | {fi:.1f} | {k.read / 1e6:.1f} / {k.written / 1e6:.1f} "
              f"| {fd:.1f} |")
    inst = sum(k.inst for k in kernels) / issue
    byt = sum(k.read + k.written for k in kernels) / dram
    print(f"\nstep {tot:.1f} us; instructions {inst:.1f} us at full issue; DRAM {byt:.1f} us; "
          f"sum over kernels of max(instr., DRAM) {roof:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
