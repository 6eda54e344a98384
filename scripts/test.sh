#!/usr/bin/env bash
# The project's test command: sets up the environment, then runs the whole suite (CPU only, about 15-22 minutes
# on 2 cores) and lists its slowest tests, so the suite's time stays visible.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
exec "$VENV/bin/python" -m pytest -q --durations=20 "$@"
