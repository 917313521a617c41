#!/usr/bin/env bash
# The orchestration and cold-tier issues' GPU runs (issues 31 and 33), in stages that each fit one device call
# (10 minutes) and leave their logs in the output folder even when cut short (every stage under `timeout`).
#
#   # on the GPU machine, from the repository root, after the payload's parts were carried (device_payload.sh):
#   bash benchmarks/system_gpu_check.sh "$OUT" [STAGE...]     # stages: stack spill decode prefix (default all)
#
# stack  : `planekv up --workers 1 --reader triton`, status, a generation on the GPU worker, a perplexity window
#          and 4 passkey trials at 8K over an evaluation worker beside it (`--address stack`), the same two in one
#          process on the GPU compared row by row (benchmarks/tools/compare_eval.py), `planekv down`, and what is
#          left running
# spill  : the spill tier's kvikio reads against a plain kvikio loop (pages, runs, blocks; BENCHMARKS.md)
# decode : decode steps at B = 1 T = 131072 with the refinement planes in host memory and in spill files
# prefix : time to first token of a reused 32K prefix against a fresh prefill (SmolLM2, Triton reader)
set -uo pipefail
out=${1:?usage: system_gpu_check.sh OUT_DIR [stack spill decode prefix]}
shift
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(stack spill decode prefix)
limit=${STAGE_TIMEOUT_S:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
eval "$(bash benchmarks/device_payload.sh 2>"$out/payload.log")" || { tail "$out/payload.log"; exit 1; }
export PYTHONPATH="$PWD:$PYTHONPATH"
run() {  # run NAME CMD...: the command under `timeout`, its output in NAME.log; a failure does not stop the rest
  local name=$1; shift
  echo "== $name: $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $?"; grep -v "logging.cc\|^    @" "$out/$name.log" | tail -20
}
stack() {
  python -m planekv.cli up --workers 1 --reader triton --free-ports || return 1
  python -m planekv.cli status
  python -c "from planekv.orchestration import connect; c = connect(); c.wait_ready(); \
print(c.generate(['Name three colours.'], max_new_tokens=16, rate=2.0))"
  python -m planekv.cli eval perplexity --workers 1 --address stack --device cuda --out "$out/ppl" --window 512 \
    --windows 1
  local rc=$?
  local cal; cal=$(ls "$out"/ppl/calibration-*.pt | head -1)
  python -m planekv.cli eval passkey --workers 1 --address stack --device cuda --out "$out/pk" --calibration "$cal" \
    --contexts 8192 --trials 4 --systems dense readkv-flexible --rates 2 --reader triton || rc=1
  # the same two evaluations in one process on the same GPU, with the same calibration: the tables must agree
  python -m planekv.cli eval perplexity --device cuda --out "$out/ppl1" --window 512 --windows 1 --calibration "$cal" \
    || rc=1
  python -m planekv.cli eval passkey --device cuda --out "$out/pk1" --calibration "$cal" --contexts 8192 --trials 4 \
    --systems dense readkv-flexible --rates 2 --reader triton || rc=1
  python benchmarks/tools/compare_eval.py "$out/ppl/perplexity.json" "$out/ppl1/perplexity.json" || rc=1
  python benchmarks/tools/compare_eval.py "$out/pk/passkey.json" "$out/pk1/passkey.json" || rc=1
  python -m planekv.cli down
  sleep 2
  echo "left running after down:"; ps -eo pid,stat,cmd | grep -E "redis-server|raylet|gcs_server|uvicorn|ray::" \
    | grep -v grep
  return $rc
}
for stage in "${stages[@]}"; do
  case $stage in
    stack) export -f stack; export out; run stack bash -c stack ;;
    spill) run spill python -m planekv.cli bench spill --backend kvikio --device cuda --blocks 64 --block-mib 1 \
             --page-kib 16 --reps 3 --modes page run block --json "$out/spill.json" ;;
    decode) for t in host nvme; do
              run "decode-$t" python -m planekv.cli bench tiering --source synthetic --tokens 131072 --steps 6 \
                --layers 1 --policies flex-r2 --hots 4 --reader triton --tier "$t" --json "$out/decode-$t.json"
            done ;;
    prefix) run prefix python -m planekv.cli bench prefix --model smollm2 --tokens 32768 --suffix 16 --reps 5 \
              --reader triton --device cuda --json "$out/prefix-32k.json" ;;
    *) echo "unknown stage $stage (stack spill decode prefix)"; exit 2 ;;
  esac
done
