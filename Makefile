# hoplite_gpu developer targets. Every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: help venv demo test test-fast lint bench bench-cluster soak fuzz clean docker docker-test docker-tools

help:
	@echo "make demo   - install into .venv and run the demo (broadcast, reduce, allreduce) locally"
	@echo "make test   - install into .venv and run the whole test suite"
	@echo "make lint   - ruff + mypy"
	@echo "make bench  - point-to-point, collective and recovery benchmarks"
	@echo "make bench-cluster - collectives vs MPI, Gloo and Ray on an emulated cluster of 4 and 8 hosts (root)"
	@echo "make soak   - randomized fault soak (1000 runs; HOPLITE_SOAK_RUNS, HOPLITE_SOAK_SEED)"
	@echo "make fuzz   - the message fuzz suite, longer (HOPLITE_FUZZ_EXAMPLES, default 20000)"
	@echo "make docker - build the directory, GPU worker and Ray images with podman (docker/README.md)"
	@echo "make docker-test - build the images, check them and smoke-test them across containers (root)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e ".[cpu,test,lint,bench]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hoplite-gpu demo

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not multiprocess"

lint: $(STAMP)
	$(VENV)/bin/ruff check hoplite_gpu tests bench examples docker
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/p2p.py
	$(PY) bench/collectives.py --workers 4 --paths shm,ucx
	$(PY) bench/recovery.py --size 64MiB --repeat 5 --json bench/results/recovery.json
	$(VENV)/bin/hoplite-gpu demo --workers 4

# The peers of the cluster benchmark: Debian's Open MPI (mpi4py is built against it), torch's gloo
# and Ray, from the `peers` extra.
PEERS_STAMP := $(VENV)/.peers-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(PEERS_STAMP): $(STAMP)
	command -v tc >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2)
	command -v mpicc >/dev/null || (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev)
	$(PY) -m pip install --quiet -e ".[peers]"
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

soak: $(STAMP)
	HOPLITE_SOAK_RUNS=$${HOPLITE_SOAK_RUNS:-1000} $(PY) -m pytest -q -s tests/test_soak.py

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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
