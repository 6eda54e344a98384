#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with everything the server, tests and benchmarks need.
# CPU machines get the CPU build of torch 2.13.0; a plain `torch` requirement would pull a multi-GB CUDA build.
# stdout carries one line, the environment's absolute path: VENV="$(bash scripts/setup_env.sh | tail -n 1)" works
# from any directory. Progress (a line per step; minutes from nothing) goes to stderr when stderr is a
# terminal or VOXBACKEND_PROGRESS=1 (0: never). A rerun for the same checkout, pyproject.toml and this script skips
# pip altogether (the stamp file below) and takes a moment.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2  # what the steps print goes to stderr; only the path goes to the real stdout (fd 3)
VENV="${VOXBACKEND_VENV:-.venv}"  # a relative path is taken from the repository root
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
STAMP="$VENV/.voxbackend-setup"  # written once every step succeeded: what the environment was installed from
WANT="$( { cat pyproject.toml scripts/setup_env.sh; pwd -P; } | sha256sum | cut -d ' ' -f 1) $(pwd -P)"

PROGRESS=0
if [ "${VOXBACKEND_PROGRESS:-}" = 1 ] || { [ -z "${VOXBACKEND_PROGRESS:-}" ] && [ -t 2 ]; }; then
  PROGRESS=1
fi
STEP=0
STEPS=0
STEP_ERR=""  # while a step runs with progress on: the file holding its stderr
step() {  # step LABEL COMMAND...: run COMMAND; with progress on, inside a line "setup [n/N] LABEL ... done (S s)"
  STEP=$((STEP + 1))
  if [ "$PROGRESS" = 0 ]; then
    "${@:2}"
    return
  fi
  local t0=$SECONDS
  printf 'setup [%d/%d] %s ...' "$STEP" "$STEPS" "$1" >&2
  STEP_ERR="$(mktemp)"
  "${@:2}" 2>"$STEP_ERR"  # its messages (pip's warnings) follow the finished line instead of splitting it
  printf ' done (%d s)\n' $((SECONDS - t0)) >&2
  cat "$STEP_ERR" >&2
  rm -f "$STEP_ERR"
  STEP_ERR=""
}
# a failing step ends the script (set -e): finish its line and show what it printed
trap 'if [ -n "$STEP_ERR" ]; then echo " failed" >&2; cat "$STEP_ERR" >&2; rm -f "$STEP_ERR"; fi' EXIT

make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  rm -f "$STAMP"  # the environment is about to change: no stamp until every step below has succeeded
}
pip_install() {
  "$VENV/bin/python" -m pip install -q "$@"
}
upgrade_pip() {
  pip_install --upgrade pip >/dev/null
}
install_oracles() {
  local oracle
  for oracle in cosyvoice:cosyvoice-minicpmo==0.1.0 step_audio2:step-audio2==1.0.0 scipy:scipy==1.15.3 \
      s3tokenizer:s3tokenizer==0.3.0 chatterbox:chatterbox-tts==0.1.7; do
    if [ ! -d "$VENV/oracles/${oracle%%:*}" ]; then
      pip_install --no-deps --target "$VENV/oracles/${oracle%%:*}" "${oracle#*:}"
    fi
  done
}
install_libb64() {
  (apt-get update -qq && apt-get install -y -qq libb64-0d) >/dev/null 2>&1 \
    || echo "warning: could not install libb64-0d; perf_analyzer tests will skip"
}
install_haproxy() {
  (apt-get update -qq && apt-get install -y -qq haproxy) >/dev/null 2>&1 \
    || echo "warning: could not install haproxy; tests/test_triton_failover.py will fail"
}
install_chromium() {
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
    || echo "warning: could not install chromium and chromium-driver; tests/test_api_page.py will fail"
}

UP_TO_DATE=0
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  UP_TO_DATE=1
fi
CAN_APT=0
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  CAN_APT=1
fi
# perf_analyzer (inside the tritonclient 2.51.0 wheel) links against libb64
NEED_LIBB64=0
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
  NEED_LIBB64=$CAN_APT
fi
# the fail-over test runs deploy/haproxy/haproxy.cfg with Debian's haproxy
NEED_HAPROXY=0
if ! command -v haproxy >/dev/null; then
  NEED_HAPROXY=$CAN_APT
fi
# the speech API's browser test drives Debian's chromium through its chromedriver (no browser download)
NEED_CHROMIUM=0
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  NEED_CHROMIUM=$CAN_APT
fi
STEPS=$(( (UP_TO_DATE ? 0 : 7) + NEED_LIBB64 + NEED_HAPROXY + NEED_CHROMIUM ))
T0=$SECONDS

if [ "$UP_TO_DATE" = 0 ]; then
  step "virtual environment $VENV ($([ -x "$VENV/bin/python" ] && echo reused || echo new))" make_venv
  step "pip" upgrade_pip
  step "torch 2.13.0" pip_install "torch==2.13.0"
  step "voxbackend (editable) with its test, triton, perf, api and api-test extras" \
    pip_install -e ".[test,triton,perf,api,api-test]"
  # the streaming Mimi test oracle; --no-deps because its pins (torch, bitsandbytes, sounddevice...) are not ours
  step "moshi 0.2.13 (Mimi test oracle)" pip_install --no-deps "moshi==0.2.13"
  # the CosyVoice2 flow + HiFT oracles, each in its own folder that only tests/cosyvoice_oracle.py puts on sys.path:
  # they declare torchaudio (which would replace our torch) and install top-level `cosyvoice`, `matcha`, `utils`,
  # `token2wav` modules that must stay out of the server's environment
  # the voice-cloning front end's oracles (S3 tokenizer v2; the CAMPPlus torch class in chatterbox's xvector.py) the
  # same way: s3tokenizer declares torchaudio and onnx, chatterbox-tts pins its own torch;
  # tests/cosyvoice_frontend_oracle.py loads them
  step "test oracles in $VENV/oracles (CosyVoice2, Step-Audio2, SciPy, s3tokenizer, chatterbox)" install_oracles
  # the Qwen3-TTS oracle (reference code ported to transformers 5); --no-deps because it declares torchaudio, sox,
  # onnxruntime, librosa and gradio, none of which its 12 Hz path uses (tests/qwen_tts_oracle.py stands in for them);
  # what it does import (transformers, einops, soundfile, numpy, huggingface_hub) comes with .[test]
  step "qwen-tts-hf (Qwen3-TTS oracle)" pip_install --no-deps "qwen-tts-hf==0.1.1.post1"
fi
if [ "$NEED_LIBB64" = 1 ]; then
  step "libb64 (apt, for perf_analyzer)" install_libb64
fi
if [ "$NEED_HAPROXY" = 1 ]; then
  step "haproxy (apt, for the fail-over test)" install_haproxy
fi
if [ "$NEED_CHROMIUM" = 1 ]; then
  step "chromium and chromium-driver (apt, for the speech API's browser test)" install_chromium
fi
if [ "$UP_TO_DATE" = 0 ]; then
  echo "$WANT" >"$STAMP"
fi
if [ "$PROGRESS" = 1 ]; then
  if [ "$UP_TO_DATE" = 1 ]; then
    echo "setup: environment up to date ($VENV)" >&2
  else
    echo "setup: environment ready in $((SECONDS - T0)) s ($VENV)" >&2
  fi
fi
echo "$VENV" >&3
