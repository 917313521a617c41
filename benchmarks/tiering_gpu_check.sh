#!/usr/bin/env bash
# The tiering issue's GPU run (docs/TIERING.md): the full-size checks of the tiered read and the step times.
#
#   # on the GPU machine (the device tool), from the repository root:
#   bash benchmarks/tiering_gpu_check.sh "$OUT"
#
# Writes gpu-tiered.txt (the tiered read against the reference at full size), tiering-timing.json (SDPA, FP8, the
# all-GPU reader with its default and its FMA stages, the tiered read at h = 4 and 2 (with and without Key
# refinement, Key pages 64 MiB per layer), the whole-chunk offload
# baseline, at B = 32 T = 32768 and in SmolLM2's geometry, GPU bytes of a 32-layer model and the largest batch in
# 40 GiB) and tiering-decode.json (synthetic decode steps through the Triton tiered read: caps and hits).
set -euo pipefail
out=${1:?usage: tiering_gpu_check.sh OUT_DIR}
mkdir -p "$out"
PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu -k tiered -p no:cacheprovider 2>&1 | tee "$out/gpu-tiered.txt" | tail -5
PYTHONPATH=$PWD python -m planekv.cli bench tiering --timing-only --timing b32-t32k smollm2-b32-t8k \
  --policies flex-r4 flex-r2 flex-kr-r4 flex-kr-r2 --hots 4 2 --promotion-mib 64 --key-page-mib 64 --reps 30 \
  --json "$out/tiering-timing.json" | tail -40
PYTHONPATH=$PWD python -m planekv.cli bench tiering --source synthetic --tokens 8192 --steps 8 --layers 2 \
  --policies flex-r4 flex-r2 flex-kr-r4 flex-kr-r2 --hots 4 2 --key-page-mib 16 --reader triton \
  --json "$out/tiering-decode.json" | tail -20
