# moesplit — every target does its own set-up; `make demo` and `make test` work on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup setup-test protos build test soak nethosts demo bench bench-tcp-hosts bench-decode bench-doctor bench-grammar bench-tool-stream bench-kernels bench-prefix bench-v4-decode gpu-check gpu-check-dry-run chart-check images image-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(filter-out cpu_expert_service/kernels/_moe.c,$(wildcard cpu_expert_service/kernels/*.pyx cpu_expert_service/kernels/*.c cpu_expert_service/kernels/*.h)) $(wildcard wire/*.h wire/*.c wire/*.pxi)
	scripts/setup_build.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	scripts/install_torch.sh $(PY)
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# Debian packages used by tests (Prometheus for the metrics test).
setup-test: setup
	scripts/setup_test.sh

protos: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/moesplit/v1/*.proto

build: setup
	scripts/setup_build.sh
	$(PY) setup.py -q build_ext --inplace

test: setup-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

# 32 concurrent streams for 2 minutes against the local stack (`make test` runs a 15 s form).
soak: setup
	MOESPLIT_SOAK_S=120 $(PY) -m pytest -q -s tests/test_soak.py

# Experts on other hosts: GPU service and 2 shard replicas in their own network namespaces (root), with faults.
nethosts: setup
	$(PY) -m pytest -q -s tests/test_nethosts_faults.py tests/test_nethosts.py tests/test_nethosts_acceptance.py

demo: setup
	$(PY) -m gpu_service.entrypoints.demo

bench-kernels: build
	$(PY) bench/bench_kernels.py

# `moesplit doctor` vs bench-kernels' ceilings (alternating, one session), `moesplit bench` on a tiny checkpoint
bench-doctor: build
	$(PY) bench/bench_doctor.py

bench: setup
	$(PY) bench/bench_pipeline.py
	$(PY) bench/bench_decode.py
	$(PY) bench/bench_grammar.py
	$(PY) bench/bench_tcp_hosts.py --out bench/results/tcp_hosts.json

# one MoE layer's expert call across two network namespaces (TCP data path, C / Python ends) vs shared memory
bench-tcp-hosts: build
	$(PY) bench/bench_tcp_hosts.py --out bench/results/tcp_hosts.json

# structured outputs: a 30-property schema's compile time, the sampler's masking overhead at batch 1 and 16
bench-grammar: setup
	$(PY) bench/bench_grammar.py

# Chat output parsers per streamed token at the start vs the end of a 4,000-character tool call
# (DeepSeek-V4's incremental parsers vs V3.1's re-parsing ones; bench/results/tool_stream.json)
bench-tool-stream: setup
	$(PY) bench/bench_tool_stream.py

# the decode step's fixed cost per MoE layer (3 vs 27 layers) and 1/8/32 streams through `moesplit serve`
bench-decode: setup
	$(PY) bench/bench_decode.py

# DeepSeek-V4 tiny-model decode tok/s at 1, 4 and 8 streams, this tree vs the merge base with main
# (bench/results/v4_decode.json)
bench-v4-decode: setup
	$(PY) bench/bench_v4_decode.py

gpu-check:  # offline, the interpreter's own CUDA torch (PYTHON=...); no venv, no download (docs/gpu-first-run.md)
	scripts/gpu_check.sh

# the same script on a CPU, everything but CUDA (tests/test_gpu_check_script.py runs it in `make test`)
gpu-check-dry-run: setup
	PYTHON=$(PY) scripts/gpu_check.sh --dry-run

chart-check: setup
	scripts/chart_check.sh

# OCI images moesplit-experts (no torch) and moesplit-gpu (TORCH=auto|cpu|cuda) with podman; installs
# podman/mmdebstrap/runc when missing. BASE=debian: a Debian base made with mmdebstrap (offline machines).
# IMAGE_REPO (default ghcr.io/moesplit, the chart's default) and IMAGE_TAG (default: the project version).
BASE ?=
IMAGE_TAG ?=
IMAGE_REPO ?=
TORCH ?=
IMAGE_ENV = $(if $(BASE),BASE=$(BASE)) $(if $(IMAGE_TAG),IMAGE_TAG=$(IMAGE_TAG)) \
            $(if $(IMAGE_REPO),IMAGE_REPO=$(IMAGE_REPO)) $(if $(TORCH),TORCH=$(TORCH))
images: setup
	$(IMAGE_ENV) scripts/build_images.sh all

# Both images from the Debian base (CPU torch), then 2 shard containers + a GPU-service container
# against the openai client (scripts/image_test.py).
image-test: setup
	$(IMAGE_ENV) BASE=debian TORCH=cpu scripts/build_images.sh all
	$(IMAGE_ENV) $(PY) scripts/image_test.py

clean:
	rm -rf build *.egg-info $(VENV)

# Prefix cache on an agent-like trace: off / GPU tier / GPU + host tier (bench/results/prefix.json + .png).
bench-prefix: setup
	$(PY) bench/bench_prefix.py
