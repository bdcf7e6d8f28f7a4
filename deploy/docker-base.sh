#!/usr/bin/env bash
# Build a Python base image without a registry: Debian bookworm (python3 3.11,
# python3-venv) made by debootstrap from Debian's package mirror, then
# `docker import`ed. Skipped when the image exists already.
#
#   deploy/docker-base.sh [IMAGE]        # default ec-daemon-base:bookworm
#
# Needs root (debootstrap) and the debootstrap package; about 1-3 minutes.
# DEBIAN_MIRROR overrides the mirror (default https://deb.debian.org/debian).
set -euo pipefail

IMAGE=${1:-ec-daemon-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PATH_VALUE=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo ">> base image $IMAGE exists: reusing it (docker rmi $IMAGE to rebuild)"
  exit 0
fi
command -v debootstrap >/dev/null \
  || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/ec-daemon-base.XXXXXX")
log="$rootfs.log"
trap 'rm -rf "$rootfs"' EXIT
echo ">> building the Debian $SUITE base image $IMAGE with debootstrap (about 1-3 minutes;" \
     "log: $log)"
start=$SECONDS
if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$rootfs" "$MIRROR" >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "debootstrap failed (log: $log)" >&2
  exit 1
fi
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
echo ">> importing $rootfs as $IMAGE"
tar -C "$rootfs" -c . | docker import -c "ENV PATH=$PATH_VALUE" -c 'CMD ["python3"]' \
  -m "debootstrap --variant=minbase $SUITE + python3, python3-venv" - "$IMAGE" >/dev/null
rm -f "$log"
echo ">> base image $IMAGE built in $((SECONDS - start))s"
