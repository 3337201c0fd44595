#!/usr/bin/env bash
# GPU check, for a machine with CUDA: installs what it needs, runs tests/gpu and a short
# GPU step benchmark. Budget: under 5 minutes. Usage: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$(mktemp -d)}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name())"
# Keep the machine's CUDA torch; add only what is missing (numba, numpy, pytest, hypothesis).
python3 -m pip install -q --no-deps -e . 2>/dev/null || python3 -m pip install -q -e .
python3 -c "import numba, hypothesis, pytest" 2>/dev/null || \
    python3 -m pip install -q "numba>=0.61,<0.69" pytest hypothesis
timeout 180 python3 -m pytest -q tests/gpu tests/test_hygiene.py
timeout 90 python3 -m mtpmeta bench --quick --device cuda
