#!/usr/bin/env bash
# The GPU check: the reuse benchmark, unchanged, on a CUDA machine (the node picks CUDA and bf16 itself).
# Meant for a machine without network whose Python already has torch: wheels for anything it lacks
# (cryptography, a matching transformers) may lie in .whl/ and are installed into /tmp/site.
set -euo pipefail
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
fi
export TENZRO_HOME="${TENZRO_HOME:-/tmp/tenzro-device}" PYTHONUNBUFFERED=1
out="${OUT:-bench-results}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -m node bench reuse --runs 5 --out "$out/reuse-cuda-default.json"
python3 -m node bench reuse --model hybrid --runs 5 --out "$out/reuse-cuda-hybrid.json"
