#!/usr/bin/env bash
# GPU check on a CUDA machine with no network (DESIGN section 7): install the wheels brought along, then run.
# Usage: bash perf/gpu/run.sh [WHEEL_DIR]   (WHEEL_DIR holds flashinfer-python 0.6.18.post1 + apache-tvm-ffi; the
#        goodput sweep also needs tritonserver (nvidia-pytriton 0.7.0 or /opt/tritonserver) and tritonclient[grpc]:
#        without them it says "not run" and the other steps stand)
#        bash perf/gpu/run.sh --dry-run [OUT_DIR]   the same steps on CPU at tiny sizes, installing nothing (CI)
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
if [ "${1:-}" = "--dry-run" ]; then
  exec "$PY" perf/gpu/gpu_check.py --dry-run --out "${2:-$(mktemp -d)}"
fi
WHEELS="${1:-shared/wheels}"
if ! "$PY" -c "import flashinfer" 2>/dev/null && [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" flashinfer-python apache-tvm-ffi
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || export PYTHONPATH="$PWD"
"$PY" -m pip install -q --no-index safetensors tokenizers soundfile 2>/dev/null || true
"$PY" perf/gpu/gpu_check.py --out perf/results
