#!/usr/bin/env bash
# The project's test command: sets up the environment, lints, then runs the whole suite (CPU only, about 7.5 minutes on
# 2 cores; `--quick`: the tests that start no tritonserver; `--unit`: those that use no reference package either)
# and lists its slowest tests, so the time stays visible.
# Three pytest workers (VOXBACKEND_TEST_WORKERS), each taking whole test files, or the group of files that share the
# committed-repository server (tests/conftest.py). On 2 cores three workers finished a clean-clone run about a minute
# sooner than two: the server tests spend much of their time waiting on streams and start-ups. The tiers without
# servers keep two: their tests keep the cores busy, and a third worker made --quick slower (2 min 49 s, not 2:37).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash scripts/setup_env.sh | tail -n 1)"
TIER=()
WORKERS=3
case "${1:-}" in  # the tiers are markers that tests/conftest.py sets per module
    --quick) shift; TIER=(-m "not triton"); WORKERS=2 ;;  # unit + parity: every test that starts no tritonserver
    --unit) shift; TIER=(-m "unit"); WORKERS=2 ;;          # neither a tritonserver nor a reference package
esac
"$VENV/bin/ruff" check --quiet  # lint first (pyproject.toml [tool.ruff]): a finding fails the run in seconds
exec "$VENV/bin/python" -m pytest -q -n "${VOXBACKEND_TEST_WORKERS:-$WORKERS}" --dist loadfile --durations=20 "${TIER[@]}" "$@"
