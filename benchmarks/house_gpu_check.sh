#!/usr/bin/env bash
# The GPU check of the re-filing by stage (docs/DECISIONS.md, 2026-12-05): the kernels' times before and after,
# in one call on one machine (before, after, before, after: drift shows), and the full-size checks.
#
#   git archive 1575fc0 planekv | tar -x -C .baseline     # once, here: the code before the re-filing
#   # then, on the GPU machine (the device tool: carry .baseline), from the repository root:
#   bash benchmarks/house_gpu_check.sh "$OUT"
#
# Writes before-*.json / after-*.json (the attention benchmark at run 118's settings), ragged.json
# (benchmarks/ragged_check.py) and gpu-tests.txt (pytest -m gpu tests/gpu) to the given folder.
set -euo pipefail
out=${1:?usage: house_gpu_check.sh OUT_DIR}
mkdir -p "$out"
args=(bench attention --codebook uniform-linear-c3 --v-run 4 --shapes b32-t32k b1-t8k smollm2-b32-t8k d256-b32-t32k
      --systems sdpa readkv-flex-r2 readkv-flex-r4 readkv-flex-kr-r2 readkv-cons-r2 --reps 30)
for round in 1 2; do
  PYTHONPATH=$PWD/.baseline python -m planekv.cli "${args[@]}" --json "$out/before-$round.json" | tail -25
  PYTHONPATH=$PWD python -m planekv.cli "${args[@]}" --json "$out/after-$round.json" | tail -25
done
PYTHONPATH=$PWD python benchmarks/ragged_check.py --v-run 4 --json "$out/ragged.json" | tail -15
PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.txt" | tail -5
