#!/usr/bin/env bash
# The project's test command: sets up the environment, then runs the whole suite (CPU only, about 10-13 minutes
# on 2 cores) and lists its slowest tests, so the suite's time stays visible.
# Two pytest workers (VOXBACKEND_TEST_WORKERS), each taking whole test files (module fixtures such as one
# tritonserver per file stay in one worker): run one by one, the suite kept about one core busy.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
exec "$VENV/bin/python" -m pytest -q -n "${VOXBACKEND_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
