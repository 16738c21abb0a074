#!/usr/bin/env bash
# `make docker-test`: build the images from a clean tree (docker/build.sh, with a local base image
# when DOCKER_BASE is not given), check what can be checked of each without a GPU, and run the
# smoke test (docker/smoke.py) across containers. Removes the containers it starts; keeps the
# images (later runs reuse their layers).
set -euo pipefail
cd "$(dirname "$0")/.."
podman="${PODMAN:-podman}"
tag="${DOCKER_TAG:-latest}"  # docker/build.sh tags the version and latest
start=$(date +%s)
docker/build.sh directory worker ray
echo "== worker image: CuPy, CUDA libraries, the kernels compiled by NVRTC (no GPU here)"
"$podman" run --rm "localhost/hoplite-gpu-worker:$tag" python3 docker/check_worker.py
echo "== worker image: the GPU tests are collected and skip cleanly without a GPU"
"$podman" run --rm "localhost/hoplite-gpu-worker:$tag" \
    python3 -m pytest -p no:cacheprovider -q -m gpu tests 2>&1 | tail -1
echo "== ray image: local Ray, the directory actor, a task get and a hoplite collective group"
"$podman" run --rm --shm-size 1g -e RAY_DEDUP_LOGS=1 "localhost/hoplite-gpu-ray:$tag" \
    python3 docker/check_ray.py 2>/dev/null
echo "== smoke test across containers"
"${PYTHON:-python3}" docker/smoke.py --tag "$tag"
echo "docker-test passed in $(( $(date +%s) - start )) s"
