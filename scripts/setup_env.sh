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
"$VENV/bin/python" -m pip install -q -e ".[test,triton,perf,api,api-test]"
# the streaming Mimi test oracle; --no-deps because its pins (torch, bitsandbytes, sounddevice...) are not ours
"$VENV/bin/python" -m pip install -q --no-deps "moshi==0.2.13"
# the CosyVoice2 flow + HiFT oracles, each in its own folder that only tests/cosyvoice_oracle.py puts on sys.path:
# they declare torchaudio (which would replace our torch) and install top-level `cosyvoice`, `matcha`, `utils`,
# `token2wav` modules that must stay out of the server's environment
# the voice-cloning front end's oracles (S3 tokenizer v2; the CAMPPlus torch class in chatterbox's xvector.py) the
# same way: s3tokenizer declares torchaudio and onnx, chatterbox-tts pins its own torch; tests/cosyvoice_frontend_oracle.py
# loads them
for oracle in cosyvoice:cosyvoice-minicpmo==0.1.0 step_audio2:step-audio2==1.0.0 scipy:scipy==1.15.3 \
    s3tokenizer:s3tokenizer==0.3.0 chatterbox:chatterbox-tts==0.1.7; do
  if [ ! -d "$VENV/oracles/${oracle%%:*}" ]; then
    "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/oracles/${oracle%%:*}" "${oracle#*:}"
  fi
done
# the Qwen3-TTS oracle (reference code ported to transformers 5); --no-deps because it declares torchaudio, sox,
# onnxruntime, librosa and gradio, none of which its 12 Hz path uses (tests/qwen_tts_oracle.py stands in for them);
# what it does import (transformers, einops, soundfile, numpy, huggingface_hub) comes with .[test]
"$VENV/bin/python" -m pip install -q --no-deps "qwen-tts-hf==0.1.1.post1"
# perf_analyzer (inside the tritonclient 2.51.0 wheel) links against libb64
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libb64-0d) >/dev/null 2>&1 || echo "warning: could not install libb64-0d; perf_analyzer tests will skip"
  fi
fi
# the speech API's browser test drives Debian's chromium through its chromedriver (no browser download)
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
      || echo "warning: could not install chromium and chromium-driver; tests/test_api_page.py will fail"
  fi
fi
echo "$VENV"
