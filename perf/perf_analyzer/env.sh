# Sourced by the sweep scripts: finds perf_analyzer and the libraries it needs.
# perf_analyzer ships in the tritonclient==2.51.0 manylinux wheel (<venv>/bin/perf_analyzer); it needs
#   apt-get update && apt-get install -y libb64-0d        (libb64.so.0d)
#   pip install nvidia-cuda-runtime-cu12                   (libcudart.so.12, even on CPU-only machines)
# Verified on the dev machine (perf_analyzer has no -h; --help prints usage):
#   LD_LIBRARY_PATH=$(python -c "import nvidia.cuda_runtime as m; print(m.__path__[0])")/lib perf_analyzer --help
PYTHON=${PYTHON:-$(command -v python3)}   # the venv's python (PYTHON=/path/venv/bin/python if not on PATH)
PA=${PERF_ANALYZER:-$("$PYTHON" -c "import sysconfig; print(sysconfig.get_path('scripts'))")/perf_analyzer}
[ -x "$PA" ] || PA=$(command -v perf_analyzer || true)
[ -x "$PA" ] || { echo "perf_analyzer not found (pip install tritonclient[all]==2.51.0)" >&2; exit 1; }
CUDART=$("$PYTHON" -c "import nvidia.cuda_runtime as m; print(m.__path__[0])" 2>/dev/null)/lib
[ -d "$CUDART" ] && export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# Common knobs (override from the environment).
URL=${URL:-localhost:8001}
MODEL=${MODEL:-orpheus}
INPUT_DATA=${INPUT_DATA:-$ROOT/perf/data/pa_orpheus_max256.json}
COUNT=${COUNT:-32}           # requests per count window: multi-second streams need count, not time, windows
STABILITY=${STABILITY:-100}  # %; Poisson windows of a few dozen requests never meet PA's default 10%
MAX_TRIALS=${MAX_TRIALS:-5}
OUT=${OUT:-$ROOT/perf/results/pa}
mkdir -p "$OUT"
# Shared flags: gRPC streaming against the decoupled model; every response timestamp goes to the
# profile export, from which parse.py computes first-response (TTFA) percentiles.
pa_common=(-m "$MODEL" -u "$URL" -i grpc --streaming --input-data "$INPUT_DATA"
           --measurement-mode count_windows --measurement-request-count "$COUNT"
           -s "$STABILITY" -r "$MAX_TRIALS" --verbose-csv)
