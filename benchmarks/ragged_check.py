"""Full-size steps over sequences of ragged lengths, every sequence checked against the reference reader (GPU).

    python benchmarks/ragged_check.py [--codebook uniform-linear-c3] [--v-run 4] [--json out.json]

The benchmark's synthetic data per shape with lengths that end mid-page, hold one token, fall short of one
Key split, and so on; per shape, the flexible reader at R = 2 and R = 4 and with Key refinement. Prints, per
case, the Key and Value depth differences and the output error against planekv.kvstore.reference (the same
check as ``planekv bench attention``, on every listed sequence). A difference is expected only for gains
within float32 rounding of lambda.
"""

from __future__ import annotations

import argparse
import json

import torch

from planekv.bench import SHAPES, check_against_reference, config_with, parse_settings, synthetic_step
from planekv.kernels import TritonReader
from planekv.kvstore import CODEBOOKS, ReadPolicy

LENGTHS = {"b32-t32k": [32768, 32767, 20001, 513, 64, 1, 4095, 12345], "b1-t8k": [5000],
           "smollm2-b32-t8k": [8192, 8191, 3000, 511, 65, 2, 4097, 7000], "d256-b32-t32k": [32768, 777, 31000]}
POLICIES = {"flex-r2": ReadPolicy.flexible(2.0, 0.875), "flex-r4": ReadPolicy.flexible(4.0, 0.75),
            "flex-kr-r2": ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(LENGTHS), choices=sorted(LENGTHS))
    ap.add_argument("--codebook", default="uniform-linear-c3", choices=CODEBOOKS)
    ap.add_argument("--v-run", type=int, default=1, choices=(1, 2, 4, 8))
    ap.add_argument("--config", default="", help="ReaderConfig fields as name=value[,name=value]")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ragged_check.py runs full-size steps on a CUDA device")
    config = config_with(parse_settings(args.config))
    rows = []
    for name in args.shapes:
        shape, lens = SHAPES[name], LENGTHS[name]
        data = synthetic_step(shape, torch.device("cuda"), 0, codebook=args.codebook, v_run=args.v_run)
        data.lengths[: len(lens)] = torch.tensor(lens, dtype=torch.int32, device=data.lengths.device)
        for pname, pol in POLICIES.items():
            reader = TritonReader(data.codec, pol, config=config)
            plan = reader.plan(shape.batch, shape.tokens, data.q.device)
            row = {"shape": name, "policy": pname, "codebook": args.codebook, "v_run": args.v_run,
                   "key_stage": plan.choices.key_stage, "value_stage": plan.choices.value_stage,
                   **check_against_reference(reader, plan, data, data.codec, n_seq=len(lens))}
            print(json.dumps(row))
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
