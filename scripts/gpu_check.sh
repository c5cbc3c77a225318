#!/usr/bin/env bash
# `make gpu-check`: the checks that need an NVIDIA GPU, as one short script (< 8 minutes).
# Runs the tests marked `gpu`, a short decode benchmark on CUDA vs CPU, and records the machine
# (nvidia-smi, lscpu incl. AMX flags) — everything lands in $OUT when set (else build/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
PY=.venv/bin/python
{ nvidia-smi || true; lscpu || true; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u || true; } > "$OUT/machine.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  | tee "$OUT/torch.txt"
timeout 360 $PY -m pytest -q -m "gpu or amx" -rA -s tests/test_gpu.py tests/test_kernels.py 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
timeout 120 $PY bench/bench_gpu.py --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.txt"
echo "gpu-check: pytest exit $rc; results in $OUT"
exit "$rc"
