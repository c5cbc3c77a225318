#!/usr/bin/env bash
# Install PyTorch into the venv without ever pulling a CUDA build on a CPU-only machine.
#  - a torch that imports already (e.g. a CUDA build on a GPU box) is kept as it is;
#  - on a machine with an NVIDIA driver, the default (CUDA) torch is installed;
#  - otherwise torch==2.13.0, which resolves to the CPU wheel on this workplace's disk.
set -euo pipefail
PY=${1:-.venv/bin/python}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "install_torch: keeping $("$PY" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch>=2.4"
else
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$wheel" ]; then
    "$PY" -m pip install -q "$wheel"
  else
    "$PY" -m pip install -q "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -c "import torch; print('install_torch: installed', torch.__version__)"
