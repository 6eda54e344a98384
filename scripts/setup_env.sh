#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with everything the server, tests and benchmarks need.
# CPU machines get the CPU build of torch 2.13.0; a plain `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VOXBACKEND_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,triton,perf]"
# the streaming Mimi test oracle; --no-deps because its pins (torch, bitsandbytes, sounddevice...) are not ours
"$VENV/bin/python" -m pip install -q --no-deps "moshi==0.2.13"
# the Qwen3-TTS reference (ported to transformers 5); --no-deps: it declares torchaudio, librosa, sox, onnxruntime,
# gradio and accelerate, which the tested 12 Hz path never runs (tests/qwen_tts_ref.py gives stand-ins for the import)
"$VENV/bin/python" -m pip install -q --no-deps "qwen-tts-hf==0.1.1.post1"
# perf_analyzer (inside the tritonclient 2.51.0 wheel) links against libb64
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libb64-0d) >/dev/null 2>&1 || echo "warning: could not install libb64-0d; perf_analyzer tests will skip"
  fi
fi
echo "$VENV"
