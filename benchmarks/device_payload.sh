#!/usr/bin/env bash
# Installs the offline payload in .carry/ (wheels the GPU machine lacks, and redis-server) into /tmp/site.
#
# The GPU machine has no network and each call carries at most ~60 MiB, so the payload is cut into parts
# .carry/p1 ... .carry/p4 (each <= 55 MiB; wheels over 50 MB are split into pieces in different parts) and
# listed in .carry/MANIFEST.txt ("kind sha256 name path...", paths relative to .carry/); built on the CPU machine
# by `python3 benchmarks/tools/make_device_payload.py` (downloads from PyPI, Debian's redis-server). Carry one part per
# call (plus .carry/MANIFEST.txt); parts carried earlier stay on a warm machine. Then, from the repo root:
#
#   eval "$(bash benchmarks/device_payload.sh)"
#
# PARTIAL=1 installs the wheels (and redis) whose parts have all been carried and skips the others, so that a
# call can use what has arrived (kvikio and the services' wheels are in p1, SmolLM2's package ends in p3).
# (or: bash benchmarks/device_payload.sh && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH)
#
# It checks that every part is there (naming any missing one), joins the split wheels into /tmp/wheels,
# checks every sha256 against the manifest, installs all wheels with pip --target /tmp/site --no-deps, puts the
# real redis-server in /tmp/site/libexec with its libraries in /tmp/site/lib/redis, and writes a wrapper
# /tmp/site/bin/redis-server that sets LD_LIBRARY_PATH for redis alone. Progress goes to stderr; the export
# lines go to stdout. A second run with the same manifest only prints the export lines.
set -euo pipefail

PAYLOAD=${PAYLOAD:-.carry}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-/tmp/wheels}
MANIFEST=$PAYLOAD/MANIFEST.txt
exports() { echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH"; }
log() { echo "device_payload: $*" >&2; }

[ -f "$MANIFEST" ] || { log "no $MANIFEST (carry .carry/MANIFEST.txt, run from the repo root)"; exit 1; }
stamp=$(sha256sum "$MANIFEST" | cut -d' ' -f1)
if [ -f "$SITE/.payload-installed" ] && [ "$(cat "$SITE/.payload-installed")" = "$stamp" ]; then
  log "already installed in $SITE"; exports; exit 0
fi

# 1. every path named in the manifest must be present (PARTIAL=1: install what is whole, skip the rest)
missing=$(grep -v '^#' "$MANIFEST" | while read -r _ _ _ paths; do
  for p in $paths; do [ -f "$PAYLOAD/$p" ] || echo "${p%%/*}"; done; done | sort -u | tr '\n' ' ')
if [ -n "$missing" ] && [ "${PARTIAL:-0}" != 1 ]; then
  log "missing part(s): $missing- carry .carry/<part> in a run for each (parts stay on a warm machine)"; exit 1
fi
whole() { for p in "$@"; do [ -f "$PAYLOAD/$p" ] || return 1; done; }

# 2. join and check: wheels into $WHEELS, redis files into $SITE
rm -rf "$WHEELS"; mkdir -p "$WHEELS" "$SITE/bin" "$SITE/libexec" "$SITE/lib/redis"
bad=0
while read -r kind sha name paths; do
  # shellcheck disable=SC2086
  whole $paths || { log "skipped (part missing): $name"; continue; }
  case $kind in
    whl) dest=$WHEELS/$name ;;
    redis) dest=$(mktemp) ;;
    *) continue ;;
  esac
  (for p in $paths; do cat "$PAYLOAD/$p"; done) > "$dest"
  if [ "$(sha256sum "$dest" | cut -d' ' -f1)" != "$sha" ]; then log "sha256 mismatch: $name ($paths)"; bad=1; continue; fi
  if [ "$kind" = redis ]; then
    case $name in
      redis/bin/redis-server) install -m 755 "$dest" "$SITE/libexec/redis-server" ;;
      # libstdc++/libgcc_s/libatomic from Debian 12 (libstdc++ needs GLIBC_2.36): only where the system has none
      redis/lib/fallback/*) { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q "^[[:space:]]*${name##*/} " ||
                              install -m 644 "$dest" "$SITE/lib/redis/${name##*/}" ;;
      redis/lib/*) install -m 644 "$dest" "$SITE/lib/redis/${name##*/}" ;;
    esac
    rm -f "$dest"
  fi
done < <(grep -v '^#' "$MANIFEST")
[ "$bad" = 0 ] || { log "corrupt payload, nothing installed"; exit 1; }

# 3. the wheels (no index, no deps: the manifest is the whole list)
set -- "$WHEELS"/*.whl
log "installing $# wheels into $SITE"
PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"

# 4. redis-server: a wrapper, so that nothing else loads Debian's libssl & co.
cat > "$SITE/bin/redis-server" <<EOF
#!/bin/sh
export LD_LIBRARY_PATH=$SITE/lib/redis\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec $SITE/libexec/redis-server "\$@"
EOF
chmod 755 "$SITE/bin/redis-server"
"$SITE/bin/redis-server" --version >&2 || { log "redis-server does not start (glibc >= 2.34 needed)"; exit 1; }

[ -n "$missing" ] || echo "$stamp" > "$SITE/.payload-installed"  # a partial install is redone next time
log "done"
exports
