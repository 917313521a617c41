#!/usr/bin/env bash
# The image's entrypoint (under tini). Reads the secrets mounted as files, then runs a role or the command given:
#
#   ray-head [ray start flags...]     a Ray head node: GCS on $RAY_GCS_PORT (6380), dashboard/jobs API on 8265
#   worker [worker_host flags...]     joins the Ray cluster at $RAY_ADDRESS as a node with $PLANEKV_WORKER_GPUS
#                                     GPUs, then runs planekv.orchestration.worker_host (its actor, /healthz, /metrics)
#   redis [redis-server flags...]     redis-server requiring the password in $PLANEKV_REDIS_PASSWORD_FILE: written
#                                     into a config file of mode 0600 (never on a command line), the flags after it
#   anything else                     run as given (planekv control|store ...; they read PLANEKV_REDIS_PASSWORD_FILE
#                                     themselves)
set -euo pipefail

# Secrets come as files (compose secrets, Kubernetes Secret volumes), so they stay out of `docker inspect`.
if [ -n "${PLANEKV_API_TOKEN_FILE:-}" ]; then
    [ -s "$PLANEKV_API_TOKEN_FILE" ] || { echo "entrypoint: $PLANEKV_API_TOKEN_FILE is missing or empty" >&2; exit 1; }
    PLANEKV_API_TOKEN=$(<"$PLANEKV_API_TOKEN_FILE")
    export PLANEKV_API_TOKEN
    unset PLANEKV_API_TOKEN_FILE
fi
if [ "${RAY_AUTH_MODE:-}" = token ] && [ ! -s "${RAY_AUTH_TOKEN_PATH:-/nonexistent}" ]; then
    echo "entrypoint: RAY_AUTH_MODE=token but RAY_AUTH_TOKEN_PATH (${RAY_AUTH_TOKEN_PATH:-unset}) is missing or empty" >&2
    exit 1
fi

# The address other Ray nodes reach this one at: the pod IP (Kubernetes sets RAY_NODE_IP), else the container's.
node_ip() { echo "${RAY_NODE_IP:-$(hostname -i | awk '{print $1}')}"; }

case "${1:-}" in
redis)
    shift
    : "${PLANEKV_REDIS_PASSWORD_FILE:?set PLANEKV_REDIS_PASSWORD_FILE to the file holding the Redis password}"
    [ -s "$PLANEKV_REDIS_PASSWORD_FILE" ] || {
        echo "entrypoint: $PLANEKV_REDIS_PASSWORD_FILE is missing or empty" >&2; exit 1; }
    password=$(<"$PLANEKV_REDIS_PASSWORD_FILE")
    password=${password//\\/\\\\}  # redis.conf quoting: backslashes, then double quotes, escaped
    password=${password//\"/\\\"}
    conf=$(umask 077 && mktemp "${TMPDIR:-/tmp}/redis-XXXXXX.conf")
    printf 'requirepass "%s"\n' "$password" >"$conf"
    unset password
    exec redis-server "$conf" "$@"
    ;;
ray-head)
    shift
    exec ray start --head --block --node-ip-address="$(node_ip)" --port="${RAY_GCS_PORT:-6380}" \
        --dashboard-host=0.0.0.0 --dashboard-port="${RAY_DASHBOARD_PORT:-8265}" --include-dashboard=true \
        --num-gpus=0 --disable-usage-stats "$@"
    ;;
worker)
    shift
    : "${RAY_ADDRESS:?set RAY_ADDRESS to the GCS address of the Ray head, host:port}"
    gpus=${PLANEKV_WORKER_GPUS:-0}
    # The head may still be starting (Kubernetes has no depends_on): retry for up to ~2 minutes.
    for attempt in $(seq 1 24); do
        if ray start --address="$RAY_ADDRESS" --node-ip-address="$(node_ip)" --num-gpus="$gpus" \
            --disable-usage-stats; then
            break
        fi
        [ "$attempt" -lt 24 ] || { echo "entrypoint: could not join the Ray cluster at $RAY_ADDRESS" >&2; exit 1; }
        sleep 5
    done
    exec python -m planekv.orchestration.worker_host --address "$RAY_ADDRESS" --gpus "$gpus" --host 0.0.0.0 \
        --index "${PLANEKV_WORKER_INDEX:-0}" "$@"
    ;;
*)
    exec "$@"
    ;;
esac
