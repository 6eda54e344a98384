"""Play one sentence through the speech API into a WAV file, and say how it streamed (stdlib only).

    python -m voxbackend.api.speak --url http://localhost:9000 --text "Hello there." --out hello.wav

It posts to /v1/audio/speech with response_format "pcm", reads the body as it arrives and prints time to first
audio, the pieces received and x real time (audio seconds / wall seconds, higher is better).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

import numpy as np


def speak(url: str, text: str, model: str = "orpheus", voice: str | None = None, **extra) -> dict:
    body = {"model": model, "input": text, "response_format": "pcm",
            **({"voice": voice} if voice else {}), **{k: v for k, v in extra.items() if v is not None}}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/audio/speech", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    pieces, ttfa = [], None
    with urllib.request.urlopen(request, timeout=600) as r:
        rate = int(r.headers.get("X-Sample-Rate", "24000"))
        while piece := r.read1(65536):
            ttfa = ttfa if ttfa is not None else time.monotonic() - t0
            pieces.append(piece)
    data = b"".join(pieces)
    audio = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2")
    return {"audio": audio, "sample_rate": rate, "ttfa_s": ttfa, "pieces": len(pieces),
            "wall_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://localhost:9000")
    ap.add_argument("--model", default="orpheus")
    ap.add_argument("--text", default="Hello there, this is a streaming speech server.")
    ap.add_argument("--voice")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--out", default="out.wav")
    a = ap.parse_args(argv)
    try:
        got = speak(a.url, a.text, a.model, a.voice, seed=a.seed, max_tokens=a.max_tokens)
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    import soundfile as sf

    sf.write(a.out, got["audio"], got["sample_rate"], subtype="PCM_16")
    audio_s = got["audio"].size / got["sample_rate"]
    ttfa = f"{1000 * got['ttfa_s']:.0f} ms" if got["ttfa_s"] is not None else "-"
    print(f"TTFA {ttfa} | pieces {got['pieces']} | audio {audio_s:.2f} s in {got['wall_s']:.2f} s wall = "
          f"{audio_s / got['wall_s']:.2f}x real time (audio s / wall s) | via {a.url}/v1/audio/speech")
    print(f"wrote {a.out} ({got['sample_rate']} Hz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
