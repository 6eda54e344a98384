#!/usr/bin/env bash
# The server's main job end to end on the default model: set up the environment, start tritonserver on free
# loopback ports with the model repository, stream one sentence through the `orpheus` model with the
# tritonclient gRPC streaming client into a WAV file, stop the server.
# Usage: bash scripts/demo.sh ["Text to speak."] [out.wav] [--api]   (--api: through the speech API, voxbackend.api)
# The WAV lands where you run it from; the environment is the checkout's (scripts/setup_env.sh).
set -euo pipefail
ROOT="$(cd -P "$(dirname "$0")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
exec "$VENV/bin/voxbackend" demo --text "${1:-Hello there, this is a streaming speech server.}" --out "${2:-hello.wav}" --max-tokens 420 "${@:3}"
