#!/usr/bin/env bash
# Build the two OCI images, moesplit-experts (no torch) and moesplit-gpu, with podman.
#
#   scripts/build_images.sh [all|tools|base|prepare|build|names]     (default: all; `make images`)
#
#   tools    install podman, mmdebstrap and runc with apt when one is missing
#   base     BASE=debian only: a minimal Debian base (python3, venv, tini) from Debian's packages with
#            mmdebstrap, imported as localhost/moesplit-base:<suite> (kept; delete it to rebuild)
#   prepare  resolve every Python package on this host (the project's wheel, built here with its
#            Cython kernels for every ISA; its dependencies pinned to the versions in the venv) into
#            build/images/wheels/, which the Containerfiles install offline (--no-index). The image
#            builds never reach a package index, so they never need this host's CA bundle.
#   build    podman build of both Containerfiles (deploy/images/), then names and sizes
#   names    print the two image names and stop
#
# Environment:
#   BASE       base image of both images: a registry image (default docker.io/library/python:3.11-slim-bookworm)
#              or `debian` (the mmdebstrap base, for machines that reach only Debian's packages and PyPI)
#   IMAGE_REPO registry/namespace of the names (default ghcr.io/moesplit: the chart's default repositories)
#   IMAGE_TAG  tag (default: the project version from pyproject.toml, the chart's appVersion)
#   TORCH      torch of moesplit-gpu: auto (default: cuda where `nvidia-smi -L` works, else cpu, the rule of
#              scripts/install_torch.sh), cpu or cuda. A cpu build never downloads a CUDA torch.
#   PODMAN_FLAGS  extra flags for `podman build` (default: --runtime runc --network host and ulimits below
#              the hard limits, what podman needs on this workplace's hosts; set to "" elsewhere)
#   ONLY       experts|gpu: build one image
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -n1)
IMAGE_TAG=${IMAGE_TAG:-$VERSION}
IMAGE_REPO=${IMAGE_REPO:-ghcr.io/moesplit}
BASE=${BASE:-docker.io/library/python:3.11-slim-bookworm}
TORCH=${TORCH:-auto}
ONLY=${ONLY:-}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_BASE=localhost/moesplit-base:$DEBIAN_SUITE
BASE_PYTHON=3.11  # the python3 of the base images (Debian bookworm): the project wheel's ABI
OUT=build/images
WHEELS=$OUT/wheels
read -r -a PODMAN_FLAGS <<<"${PODMAN_FLAGS---runtime runc --network host --ulimit nofile=1024:1024 --ulimit nproc=1000:1000}"
EXPERTS=$IMAGE_REPO/moesplit-experts:$IMAGE_TAG
GPU=$IMAGE_REPO/moesplit-gpu:$IMAGE_TAG
# The script's own pip cache: `rm -rf build/images` is a cold build.
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$PWD/$OUT/pip-cache} PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "build_images [${SECONDS}s]: $*" >&2; }
die() { log "$*"; exit 1; }

torch_kind() {
  case "$TORCH" in
    cpu|cuda) echo "$TORCH" ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
    *) die "TORCH must be auto, cpu or cuda, not $TORCH" ;;
  esac
}

tools() {
  local missing=()
  for t in podman mmdebstrap runc; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} (apt)"
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/dev/null \
    || { $sudo apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}" >/dev/null; }
}

base_ref() { if [ "$BASE" = debian ]; then echo "$DEBIAN_BASE"; else echo "$BASE"; fi; }

base() {
  [ "$BASE" = debian ] || return 0
  if podman image exists "$DEBIAN_BASE"; then log "base $DEBIAN_BASE exists"; return 0; fi
  mkdir -p "$OUT"
  log "mmdebstrap $DEBIAN_SUITE (minbase + python3, python3-venv, tini) from $DEBIAN_MIRROR"
  rm -f "$OUT/rootfs.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,tini \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    "$DEBIAN_SUITE" "$OUT/rootfs.tar" "$DEBIAN_MIRROR"
  podman import --quiet --change 'CMD ["/bin/bash"]' "$OUT/rootfs.tar" "$DEBIAN_BASE" >/dev/null
  rm -f "$OUT/rootfs.tar"
  log "imported $DEBIAN_BASE"
}

# Hash of the files that go into the project wheel (tracked and untracked-not-ignored, minus tests/docs).
source_hash() {
  { git ls-files -co --exclude-standard -z -- . ':!tests' ':!docs' ':!bench' ':!deploy' ':!README.md' ':!.venv' ':!scripts' ':!.ci' ':!Makefile' ':!.containerignore' ':!.dockerignore' \
      | xargs -0 sha256sum 2>/dev/null || true; } | sha256sum | cut -c1-16
}

prepare() {
  [ -x "$PY" ] || die "$PY missing: run make setup first"
  local pyver; pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$pyver" = "$BASE_PYTHON" ] || die "the venv runs Python $pyver; the images' python3 is $BASE_PYTHON (the project wheel's ABI)"
  mkdir -p "$WHEELS"
  local h; h=$(source_hash)
  if [ "$(cat "$WHEELS/project/.hash" 2>/dev/null)" != "$h" ]; then
    log "project wheel (Cython kernels: every ISA, run-time dispatch)"
    rm -rf "$WHEELS/project"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS/project" .
    echo "$h" >"$WHEELS/project/.hash"
  fi
  local wheel; wheel=$(ls "$PWD/$WHEELS"/project/moesplit-*.whl)
  # The versions the venv runs (and the tests pass with), torch aside (chosen by TORCH below).
  "$PY" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' | grep -viE '^(moesplit|torch)==' \
    >"$OUT/constraints.txt"
  local pipdl=("$PY" -m pip download -q --only-binary=:all: -c "$OUT/constraints.txt")

  # A resolution is kept while its inputs (the project wheel, the pins, the torch choice) are unchanged.
  local key_base; key_base=$(cat "$WHEELS/project/.hash" "$OUT/constraints.txt" | sha256sum | cut -c1-16)
  if [ "$ONLY" != gpu ] && [ "$(cat "$WHEELS/experts/.key" 2>/dev/null)" = "$key_base" ]; then
    log "moesplit-experts' packages resolved already"
  elif [ "$ONLY" != gpu ]; then
    log "resolving moesplit-experts' packages (no torch)"
    rm -rf "$WHEELS/experts.new"
    "${pipdl[@]}" -d "$WHEELS/experts.new" "moesplit @ file://$wheel" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    rm -f "$WHEELS"/experts.new/moesplit-*.whl
    ! ls "$WHEELS"/experts.new/torch-* >/dev/null 2>&1 || die "torch resolved into moesplit-experts"
    echo "$key_base" >"$WHEELS/experts.new/.key"
    rm -rf "$WHEELS/experts" && mv "$WHEELS/experts.new" "$WHEELS/experts"
  fi
  if [ "$ONLY" != experts ]; then
    local kind torchreq; kind=$(torch_kind)
    if [ "$kind" = cpu ]; then
      # Same rule as scripts/install_torch.sh: the CPU wheel on this workplace's disk, else PyTorch's CPU index.
      torchreq=$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)
      if [ -z "$torchreq" ]; then
        torchreq=$(ls "$OUT"/torch-cpu/torch-*.whl 2>/dev/null | head -n1 || true)
        if [ -z "$torchreq" ]; then
          "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$OUT/torch-cpu" "torch==2.13.0" \
            --index-url https://download.pytorch.org/whl/cpu
          torchreq=$(ls "$OUT"/torch-cpu/torch-*.whl | head -n1)
        fi
      fi
      torchreq="$(realpath "$torchreq")"
      local tv; tv=$(basename "$torchreq" | cut -d- -f2)
      echo "torch==$tv" >>"$OUT/constraints.txt"  # +cpu: pins the CPU build, no CUDA wheel can match
      torchreq="torch @ file://$torchreq"
    else
      torchreq="torch>=2.4"  # PyPI's default Linux torch: the CUDA build
      export PIP_FIND_LINKS=""  # not a local +cpu wheel from pip's config (it would sort above the same release)
    fi
    local key; key=$(echo "$key_base $kind $torchreq" | sha256sum | cut -c1-16)
    if [ "$(cat "$WHEELS/gpu/.key" 2>/dev/null)" = "$key" ]; then
      log "moesplit-gpu's packages resolved already (torch $kind)"; return 0
    fi
    log "resolving moesplit-gpu's packages (torch $kind)"
    rm -rf "$WHEELS/gpu.new"
    "${pipdl[@]}" -d "$WHEELS/gpu.new" "moesplit[gpu] @ file://$wheel" "$torchreq" 2>&1 \
      | grep -v "is ignored: it is neither" >&2 || true
    rm -f "$WHEELS"/gpu.new/moesplit-*.whl
    if [ "$kind" = cpu ] && ls "$WHEELS"/gpu.new/nvidia_* >/dev/null 2>&1; then die "a CUDA package resolved into a CPU build"; fi
    if [ "$kind" = cuda ] && ls "$WHEELS"/gpu.new/torch-*+cpu-* >/dev/null 2>&1; then die "TORCH=cuda resolved a CPU torch"; fi
    echo "$kind" >"$WHEELS/gpu.new/.torch"
    echo "$key" >"$WHEELS/gpu.new/.key"
    rm -rf "$WHEELS/gpu" && mv "$WHEELS/gpu.new" "$WHEELS/gpu"
  fi
}

build_one() {  # name containerfile [build-arg...]
  local name=$1 file=$2; shift 2
  log "podman build $name (FROM $(base_ref))"
  podman build "${PODMAN_FLAGS[@]}" -q -f "$file" --build-arg BASE="$(base_ref)" --build-arg VERSION="$VERSION" \
    --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$@" -t "$name" . >/dev/null
}

build() {
  [ "$ONLY" = gpu ] || build_one "$EXPERTS" deploy/images/experts.Containerfile
  [ "$ONLY" = experts ] || build_one "$GPU" deploy/images/gpu.Containerfile --build-arg TORCH="$(cat "$WHEELS/gpu/.torch")"
  sizes
}

sizes() {
  local n
  for n in $([ "$ONLY" = gpu ] || echo "$EXPERTS") $([ "$ONLY" = experts ] || echo "$GPU"); do
    printf '%s\t%s MB\n' "$n" "$(( $(podman image inspect --format '{{.Size}}' "$n") / 1000000 ))"
  done
}

cmd=${1:-all}
case "$cmd" in
  names) echo "$EXPERTS"; echo "$GPU" ;;
  tools) tools ;;
  base) tools; base ;;
  prepare) prepare ;;
  build) build ;;
  sizes) sizes ;;
  all) tools; base; prepare; build ;;
  *) die "unknown command $cmd (all|tools|base|prepare|build|names|sizes)" ;;
esac
