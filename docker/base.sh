#!/usr/bin/env bash
# Build a local Debian bookworm base image (python3, venv, pip, CA certificates) for machines that
# cannot pull from a container registry: debootstrap into a folder, then `podman import`.
# Usage: docker/base.sh [IMAGE]   (default localhost/hoplite-base:bookworm; kept if it exists)
# The host's CA certificates are added to the image so pip inside a build trusts what the host
# trusts (on machines whose outbound HTTPS goes through an intercepting proxy).
set -euo pipefail
image="${1:-localhost/hoplite-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if podman image exists "$image"; then
    echo "base image $image exists"
    exit 0
fi
root="$(mktemp -d /var/tmp/hoplite-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
start=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log"; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
if [ -d /usr/local/share/ca-certificates ]; then
    cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null 2>&1
fi
# Leave out what an image does not need: package lists and caches, docs.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null 2>&1
echo "base image $image built in $(( $(date +%s) - start )) s ($(podman image inspect "$image" --format '{{.Size}}') bytes)"
