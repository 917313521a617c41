#!/usr/bin/env bash
# Build the Debian base image that deploy/Dockerfile starts FROM, out of Debian packages alone
# (debootstrap), for machines that can reach a Debian mirror but no image registry.
#
#   sudo deploy/make-base-image.sh [TAG]          # default TAG: planekv-base:bookworm
#
# Environment: SUITE (bookworm: its python3 is 3.11), MIRROR (default http://deb.debian.org/debian),
# TIMEOUT_S (default 900: debootstrap is stopped after that, the script fails and leaves nothing behind).
# Needs root, debootstrap and a running Docker daemon. Takes about 2-5 minutes and ~400 MB of disk.
set -euo pipefail

TAG=${1:-planekv-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TIMEOUT_S=${TIMEOUT_S:-900}
# what deploy/Dockerfile needs; with them in the base its apt step is skipped (no mirror needed at build time)
PACKAGES=ca-certificates,curl,python3,python3-venv,redis-server,tini

[ "$(id -u)" -eq 0 ] || { echo "make-base-image.sh: run as root (debootstrap needs it)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "make-base-image.sh: apt-get install debootstrap" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "make-base-image.sh: no Docker daemon answers" >&2; exit 1; }

root=$(mktemp -d /tmp/planekv-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT

timeout "$TIMEOUT_S" debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR"

# debootstrap leaves the mirror it used; add the security and updates suites for later apt-get runs
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
SOURCES
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/usr/share/doc/* \
       "$root"/usr/share/man/*
# redis-server's package enables a service; there is no init in a container
rm -f "$root"/etc/systemd/system/multi-user.target.wants/redis-server.service

tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG"
echo "built $TAG"
