"""The README's first command (`scripts/demo.sh` runs `voxbackend demo` once the environment is set up): it serves
only the model it speaks, writes the WAV, and leaves no temporary folder behind."""
import re
import subprocess
import sys
from pathlib import Path

import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]


def test_demo_serves_only_its_model_writes_the_wav_and_cleans_up(tmp_path):
    out = tmp_path / "hello.wav"
    done = subprocess.run([sys.executable, "-m", "voxbackend.cli", "demo", "--text", "Hello there.", "--out", str(out),
                           "--max-tokens", "140"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rendered = re.search(r"^rendered (\S+) \((.*)\) with", done.stdout, re.M)
    assert rendered and rendered.group(2) == "orpheus", done.stdout  # not every model of the repository
    assert not Path(rendered.group(1)).parent.exists(), "the rendered repository was left behind"
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and audio.size > 0
    assert f"wrote {out}" in done.stdout
