"""One turn of a spoken conversation through Triton (a model that answers in text and speech: `step_audio2`):
send the user's clip and/or text, print the reply's text as it arrives and write its speech to a WAV file.

    python -m clients.voice_chat --audio question.wav --out reply.wav
    python -m clients.voice_chat --text "And tomorrow?" --system "You are a weather bot." \
        --history "user@question.wav" --history "assistant: It will rain today." --out reply2.wav

--history gives the earlier turns, oldest first, one flag each: "user: TEXT", "user@CLIP.wav" or
"assistant: TEXT" (an assistant turn is given by what it said). --text-only asks for a reply without speech.
Works with the front model and with `<model>_engine` (float samples). Prints TTFA (from the end of the user's clip:
the whole clip is sent with the request), chunks, stalls and x real time like clients.tts_stream.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clients.tts_stream import add_sampling_args, report, sampling_fields, write_wav
from voxbackend.stream_client import make_inputs, stream_request


def history_turn(spec: str) -> dict:
    """ "user: TEXT" | "user@CLIP" | "assistant: TEXT" -> a history turn for make_inputs."""
    role, sep, rest = spec.partition(":")
    if sep and role.strip() in ("user", "assistant"):
        return {"role": role.strip(), "text": rest.strip()}
    role, sep, path = spec.partition("@")
    if sep and role.strip() == "user":
        return {"role": "user", "audio": Path(path.strip()).read_bytes()}
    raise ValueError(f'--history {spec!r}: give "user: TEXT", "user@CLIP.wav" or "assistant: TEXT"')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--model", default="step_audio2", help="a conversation model (step_audio2) or its _engine")
    ap.add_argument("--audio", default=None, help="the user's spoken turn: a WAV/FLAC/OGG clip, any rate")
    ap.add_argument("--text", default=None, help="the user's turn in text (with or instead of --audio)")
    ap.add_argument("--system", default=None, help="the system prompt")
    ap.add_argument("--history", action="append", default=[], help='an earlier turn (repeat, oldest first): '
                    '"user: TEXT", "user@CLIP.wav" or "assistant: TEXT"')
    ap.add_argument("--voice", default=None, help="the reply's voice (default: the model's)")
    ap.add_argument("--text-only", action="store_true", help="a text reply, no speech")
    add_sampling_args(ap)
    ap.add_argument("--format", default="pcm16", choices=("pcm16", "fp32"), help="AUDIO_FORMAT (front models)")
    ap.add_argument("--seed", type=int, help="sampling seed; default: the server draws one and returns it (printed)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default="reply.wav", help="WAV file to write")
    a = ap.parse_args(argv)
    if a.audio is None and a.text is None:
        ap.error("give --audio, --text or both")
    try:
        history = [history_turn(spec) for spec in a.history]
        audio = Path(a.audio).read_bytes() if a.audio else None
    except (ValueError, OSError) as e:
        ap.error(str(e))
    inputs = make_inputs(a.text, a.voice, a.format, input_audio=audio, system_prompt=a.system, history=history,
                         speak=False if a.text_only else None, **sampling_fields(a), MAX_TOKENS=a.max_tokens,
                         SEED=a.seed)
    print("reply: ", end="", flush=True)
    out = stream_request(a.url, a.model, inputs, a.format, a.timeout,
                         on_text=lambda piece: print(piece, end="", flush=True))
    print()
    print(report(out))
    if out.chunks:  # after an error or a timeout too: what was received, said to be partial
        write_wav(a.out, out.audio, out.sample_rate or 24000)
        print(f"wrote {a.out} ({out.sample_rate} Hz, {out.audio_s:.1f} s" + (", partial: the stream ended with "
              "the error below)" if out.error else ")"))
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
