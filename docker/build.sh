#!/usr/bin/env bash
# Build the hoplite_gpu images (targets of docker/Dockerfile) from a clean tree of this repository:
# `git archive` of the committed tree plus uncommitted changes to tracked files (`git stash
# create`); untracked and ignored files (.venv, caches) never reach the build.
#
# Usage: docker/build.sh [TARGET...]   (default: directory worker ray)
# Environment: DOCKER_BASE (the base image, default the local localhost/hoplite-base:bookworm,
# built by docker/base.sh if missing), DOCKER_TAG (default: the package version), PODMAN
# (default podman; docker works too), DOCKER_BUILD_ARGS (more arguments for the build).
set -euo pipefail
cd "$(dirname "$0")/.."
podman="${PODMAN:-podman}"
base="${DOCKER_BASE:-localhost/hoplite-base:bookworm}"
tag="${DOCKER_TAG:-$(sed -n 's/^__version__ = "\(.*\)"/\1/p' hoplite_gpu/_version.py)}"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(directory worker ray)
if [ "$base" = localhost/hoplite-base:bookworm ]; then
    docker/base.sh "$base"
fi
ctx="$(mktemp -d /var/tmp/hoplite-ctx.XXXXXX)"
trap 'rm -rf "$ctx"' EXIT
tree="$(git stash create)"
git archive "${tree:-HEAD}" | tar -x -C "$ctx"
for target in "${targets[@]}"; do
    start=$(date +%s)
    # --format docker keeps the HEALTHCHECK (the OCI image format has no field for it).
    # shellcheck disable=SC2086
    "$podman" build --quiet --format docker -f "$ctx/docker/Dockerfile" --target "$target" \
        --build-arg "BASE=$base" ${DOCKER_BUILD_ARGS:-} \
        -t "localhost/hoplite-gpu-$target:$tag" -t "localhost/hoplite-gpu-$target:latest" "$ctx" >/dev/null
    size=$("$podman" image inspect "localhost/hoplite-gpu-$target:$tag" --format '{{.Size}}')
    echo "built localhost/hoplite-gpu-$target:$tag in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
done
