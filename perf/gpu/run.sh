#!/usr/bin/env bash
# GPU check on a CUDA machine with no network (DESIGN section 7): install the wheels brought along, then run.
# Usage: bash perf/gpu/run.sh [WHEEL_DIR]   (WHEEL_DIR holds flashinfer-python 0.6.18.post1 + apache-tvm-ffi)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="${1:-shared/wheels}"
if ! python3 -c "import flashinfer" 2>/dev/null && [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" flashinfer-python apache-tvm-ffi
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || export PYTHONPATH="$PWD"
python3 -m pip install -q --no-index safetensors tokenizers soundfile 2>/dev/null || true
python3 perf/gpu/gpu_check.py --out perf/results
