#!/usr/bin/env bash
# The tiering issue's GPU run (docs/TIERING.md), in stages that each fit one device call (10 minutes) and each
# leave their log and JSON in the output folder even when cut short (every stage runs under `timeout`, output
# unbuffered to a file):
#
#   # on the GPU machine (the device tool), from the repository root:
#   bash benchmarks/tiering_gpu_check.sh "$OUT" [STAGE...]      # stages: check r2 r4 smollm2 decode (default all)
#
# check   : the tiered read against the reference at full size (pytest -m gpu tests/gpu -k tiered; ~30 s)
# r2 / r4 : step times at B = 32 T = 32768 (SDPA, FP8, the all-GPU reader, the tiered read at h = 4 and 2 with and
#           without Key refinement, the whole-chunk offload baseline; ~400 s each on an H200, compile included)
# smollm2 : the same in SmolLM2's geometry, R = 4 and 2 (~150 s), promotion cache 1.5 MiB a layer
#           (SMOLLM2_PROMOTION_MIB): the share of the 4-bit cache (48 MiB a layer at B = 32 T = 8K) that 32 MiB is at
#           B = 32 T = 32K in the larger geometry, 3.1%
# decode  : synthetic decode steps through the Triton tiered read: caps, hits, error (tiering-decode.json)
# Budgets (per layer; env PROMOTION_MIB, KEY_PAGE_MIB, HOTS): promotion cache 32 MiB (a GPU-bytes total of 1.04x a
# 4-bit cache at B = 32 T = 32K, the issue's target <= 1.05x), Key page slots 64 MiB (given to the Key refinement
# policies only), hot depths 4 and 2; prefetch brings one Key plane past each channel's wanted depth (--k-margin 1).
set -uo pipefail
out=${1:?usage: tiering_gpu_check.sh OUT_DIR [check r2 r4 smollm2 decode]}
shift
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(check r2 r4 smollm2 decode)
limit=${STAGE_TIMEOUT_S:-560}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # run NAME CMD...: the command under `timeout`, its output in NAME.log; a failure does not stop the rest
  local name=$1; shift
  echo "== $name: $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $?"; tail -25 "$out/$name.log"
}
read -r -a hots <<<"${HOTS:-4 2}"
timing=(python -m planekv.cli bench tiering --timing-only --promotion-mib "${PROMOTION_MIB:-32}"
        --key-page-mib "${KEY_PAGE_MIB:-64}" --reps 10 --hots "${hots[@]}")
for stage in "${stages[@]}"; do
  case $stage in
    check) run gpu-tiered env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -m gpu tests/gpu -k tiered -p no:cacheprovider ;;
    r2) run timing-r2 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${timing[@]}" --timing b32-t32k --policies flex-r2 flex-kr-r2 \
          --json "$out/tiering-timing-r2.json" ;;
    r4) run timing-r4 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${timing[@]}" --timing b32-t32k --policies flex-r4 flex-kr-r4 \
          --json "$out/tiering-timing-r4.json" ;;
    smollm2) run timing-smollm2 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${timing[@]}" --timing smollm2-b32-t8k \
               --policies flex-r4 flex-r2 --promotion-mib "${SMOLLM2_PROMOTION_MIB:-1.5}" \
               --json "$out/tiering-timing-smollm2.json" ;;
    decode) run decode env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m planekv.cli bench tiering --source synthetic --tokens 8192 \
              --steps 8 --layers 2 --policies flex-r4 flex-r2 flex-kr-r4 flex-kr-r2 --hots 4 2 --key-page-mib 16 \
              --reader triton --json "$out/tiering-decode.json" ;;
    *) echo "unknown stage $stage (check r2 r4 smollm2 decode)"; exit 2 ;;
  esac
done
