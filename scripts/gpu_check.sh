#!/usr/bin/env bash
# `make gpu-check`: the checks that need an NVIDIA GPU, as one short offline script (< 6 minutes).
#
# It runs with the interpreter's own CUDA torch ($PYTHON, default python3; never a venv, never a
# download): the lent GPU machine reaches no package index. It
#   1. fails unless torch.cuda.is_available() ("no CUDA" otherwise: not a green skip);
#   2. builds the kernels extension in place (Cython + the C compiler there);
#   3. installs any missing wheel offline from $GPU_CHECK_WHEELS (default shared/wheels, made on a
#      connected machine with `pip download --python-version 3.12 --only-binary=:all: -d DIR PKG`)
#      into build/gpu-check-site, when that folder exists;
#   4. runs every `gpu`-marked test (tests/test_gpu.py: plan vs memory_allocated after load, a long
#      prefill's max_memory_allocated within the plan, bf16 CUDA vs fp32 CPU logits, two planned
#      GPUs, CUDA graphs vs eager decode tokens; tests/test_pipeline.py: pinned device->host copies;
#      tests/test_decode.py: the model's decode on CUDA; tests/test_doctor.py: the doctor on the GPU found)
#      and fails if any was skipped;
#   5. a short benchmark (decode tokens/s per device and dtype, time per bf16/fp8/int8 linear, decode
#      ms per step with CUDA graphs and eager at batch 1 and 8: tokens must be equal).
# Everything lands in $OUT when set (else build/gpu-check): machine.txt, torch.txt, pytest.txt,
# junit.xml, bench_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{ nvidia-smi || true; lscpu || true; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u || true; } > "$OUT/machine.txt" 2>&1
if ! "$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)" 2>&1 | tee "$OUT/torch.txt"; then
  echo "gpu-check: no CUDA: $PY has no usable CUDA torch here ($(cat "$OUT/torch.txt" | tail -n1)); run it on a machine with an NVIDIA GPU and a CUDA build of torch" >&2
  exit 1
fi
WHEELS=${GPU_CHECK_WHEELS:-shared/wheels}
if [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target build/gpu-check-site "$WHEELS"/*.whl \
    || { echo "gpu-check: installing the wheels in $WHEELS failed" >&2; exit 1; }
  export PYTHONPATH="$PWD/build/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || { echo "gpu-check: building the kernels failed (see $OUT/build.txt)" >&2; exit 1; }
timeout 300 "$PY" -m pytest -q -m gpu -rA -s -p no:cacheprovider --junitxml="$OUT/junit.xml" \
  tests/test_gpu.py tests/test_pipeline.py tests/test_decode.py tests/test_doctor.py 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
skipped=$("$PY" - "$OUT/junit.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(-1); sys.exit()
print(sum(1 for c in root.iter("testcase") if c.find("skipped") is not None))
PYEOF
)
if [ "$rc" -eq 0 ] && [ "$skipped" != "0" ]; then
  echo "gpu-check: $skipped gpu test(s) skipped (or no junit report): a gpu check that did not run is a failure" >&2
  rc=1
fi
timeout 150 "$PY" bench/bench_gpu.py --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.txt"
brc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && [ "$brc" -ne 0 ] && rc=$brc
echo "gpu-check: pytest exit $rc ($skipped skipped), bench exit $brc; results in $OUT"
exit "$rc"
