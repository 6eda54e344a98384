"""Qwen3-TTS Base: the cost of starting a stream's codec state after a voice clone's reference, by reference
length. `Qwen3TTSCodec.prime` (transformer over every frame, synthesis over the last reach_frames) against
`decode_window` over the whole reference (what priming would cost by decoding), alternated in one run so the
machine's load hits both alike; tiny random Base checkpoint, one thread.

    python perf/qwen3_tts_priming.py [--frames 13 125 375] [--repeats 5]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from voxbackend.models.qwen3_tts.codec import Qwen3TTSCodec
from voxbackend.models.qwen3_tts.tiny import write_tiny_qwen3_tts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, nargs="+", default=[13, 125, 375], help="reference lengths (12.5 Hz)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_qwen3_tts(f"{tmp}/base", variant="base", seed=1)
        codec = Qwen3TTSCodec.from_pretrained(folder / "speech_tokenizer")
    print(f"synthesis reach: {codec.reach_frames} frames")
    for frames in a.frames:
        codes = torch.randint(0, codec.codebook_size, (frames, codec.num_codebooks))
        prime = decode = 0.0
        for _ in range(a.repeats):
            state = codec.new_state()
            t = time.perf_counter()
            codec.prime(state, codes)
            prime += time.perf_counter() - t
            state = codec.new_state()
            t = time.perf_counter()
            codec.decode_window([state], [codes])
            decode += time.perf_counter() - t
        print(f"{frames:>4} reference frames ({frames / 12.5:.1f} s): prime {prime / a.repeats * 1e3:.1f} ms, "
              f"decode_window {decode / a.repeats * 1e3:.1f} ms, decode / prime {decode / prime:.1f}x")


if __name__ == "__main__":
    main()
