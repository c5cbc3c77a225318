#!/usr/bin/env bash
# `make gpu-check`: the checks that need an NVIDIA GPU, as one prepared offline script (< 8 minutes).
#
#   scripts/gpu_check.sh            the real run (a CUDA host)
#   scripts/gpu_check.sh --dry-run  everything but the CUDA parts (a CPU host; tests/test_gpu_check_script.py)
#
# It runs with the interpreter's own torch ($PYTHON, default python3; never a venv, never a
# download): the lent GPU machine reaches no package index. It
#   1. fails unless torch.cuda.is_available() ("no CUDA" otherwise: not a green skip);
#   2. installs, from $GPU_CHECK_WHEELS (default shared/wheels) when that folder exists, only the
#      wheels whose distribution is not installed, into build/gpu-check-site (on PYTHONPATH);
#   3. preflight: imports every module the checks load with fastapi/uvicorn/pydantic/openai/
#      grpc_health refused (absent there), naming what fails before any time is spent (then runs
#      what can run: the failures are problems in the report);
#   4. builds the C extensions in place (a failure is a problem in the report, not a stop);
#   5. runs every `gpu`-marked test (tests/test_gpu.py, test_decode.py, test_doctor.py, test_v4_decode.py); the tests
#      record their numbers in records.jsonl; a skipped gpu test is a failure;
#   6. bench/bench_gpu.py: decode with CUDA graphs vs eager at batch 1/8/32 (equal tokens, ms per
#      step), the same for one layer at DeepSeek-V3's real shapes, time per bf16/fp8/int8 linear;
#   7. prints one JSON (report.json; docs/gpu-first-run.md reads it) and exits 1 on any problem.
# Everything lands in $OUT when set (else build/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
REPORT="$PY scripts/gpu_check_report.py"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
  nvidia-smi 2>/dev/null; lscpu 2>/dev/null; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo 2>/dev/null | sort -u; } > "$OUT/machine.txt"
if [ "$DRY" -eq 0 ]; then
  if ! "$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count()); sys.exit(0 if torch.cuda.is_available() else 1)" > "$OUT/torch.txt" 2>&1; then
    echo "gpu-check: no CUDA: $PY has no usable CUDA torch here ($(tail -n1 "$OUT/torch.txt")); run it on a machine with an NVIDIA GPU and a CUDA build of torch (or scripts/gpu_check.sh --dry-run on a CPU)" >&2
    exit 1
  fi
  cat "$OUT/torch.txt"
else
  "$PY" -c "import torch; print('torch', torch.__version__, 'dry run: no CUDA used')" > "$OUT/torch.txt" 2>&1 \
    || { echo "gpu-check --dry-run: $PY cannot import torch" >&2; exit 1; }
fi
WHEELS=${GPU_CHECK_WHEELS:-shared/wheels}
if [ -d "$WHEELS" ]; then
  mapfile -t need < <($REPORT wheels "$WHEELS")
  if [ "${#need[@]}" -gt 0 ] && [ -n "${need[0]}" ]; then
    if "$PY" -m pip --version > /dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target build/gpu-check-site "${need[@]}"
    else  # no pip there: a wheel is a zip of what goes into site-packages
      $REPORT unpack build/gpu-check-site "${need[@]}"
    fi || { echo "gpu-check: installing ${need[*]} from $WHEELS failed" >&2; exit 1; }
  fi
  export PYTHONPATH="$PWD/build/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
rm -f "$OUT/preflight.txt"
if ! $REPORT preflight "$OUT"; then
  [ "$DRY" -eq 1 ] && { echo "gpu-check --dry-run: the checks cannot import (above)" >&2; exit 1; }
  echo "gpu-check: some checks cannot import (above; a problem in the report): running the rest" >&2
fi
if [ "$DRY" -eq 1 ]; then
  "$PY" bench/bench_gpu.py --help > /dev/null || { echo "gpu-check --dry-run: bench_gpu.py --help failed" >&2; exit 1; }
  rm -f "$OUT/junit.xml" "$OUT/records.jsonl" "$OUT/bench_gpu.json" "$OUT/build_status"
  $REPORT report "$OUT" --dry-run
  exit $?
fi
# a failed build is reported, not fatal: the tests that do not need the C extensions still run
"$PY" setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 && echo ok > "$OUT/build_status" \
  || { echo "failed" > "$OUT/build_status"; echo "gpu-check: building the C extensions failed (see $OUT/build.txt); running the tests anyway" >&2; }
rm -f "$OUT/records.jsonl" "$OUT/junit.xml" "$OUT/bench_gpu.json"
GPU_CHECK_RECORDS="$OUT/records.jsonl" timeout 300 "$PY" -m pytest -q -m gpu -rA -s -p no:cacheprovider \
  --junitxml="$OUT/junit.xml" tests/test_gpu.py tests/test_decode.py tests/test_doctor.py tests/test_v4_decode.py 2>&1 | tee "$OUT/pytest.txt"
timeout 150 "$PY" bench/bench_gpu.py --out "$OUT/bench_gpu.json" > "$OUT/bench.txt" 2>&1
echo "gpu-check: bench exit $? (log $OUT/bench.txt)"
$REPORT report "$OUT"
