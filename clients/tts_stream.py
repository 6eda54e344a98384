"""Stream one text to speech through Triton (tritonclient gRPC streaming) and write a WAV file.

    python -m clients.tts_stream --url localhost:8001 --model orpheus --text "Hello there." --out hello.wav
    python -m clients.tts_stream --model csm --speaker 1 --text "Nice to meet you." \
        --context-text "Hi, I'm calling about the flat." --context-audio turn1.wav --out reply.wav

Text in pieces (a model's `<model>_text_stream`, docs/text_streaming.md): the pieces of one utterance go as one
Triton sequence on one gRPC stream, and TTFA is measured from the first piece sent:

    python -m clients.tts_stream --model qwen3_tts_text_stream --text-pieces "Hello the|re, how are| you?" \
        --piece-delay 0.2 --out hello.wav
    my_llm | python -m clients.tts_stream --model qwen3_tts_text_stream --stdin --out reply.wav  # a line = a piece

Prints time to first audio (TTFA), chunks, stalls and on-time chunks (docs/metrics.md), audio seconds and
"x real time" (audio seconds / wall seconds, higher is better). Works with every front model (`orpheus`, `csm`,
`qwen3_tts`, `cosyvoice2`, `chatterbox`, `chatterbox_turbo`: AUDIO is encoded bytes, PCM16 or float32), with
their `<model>_engine` directly (AUDIO is float32 samples) and with the `<model>_text_stream` models.

On the tiny default checkpoints (random weights) a model rarely picks its end token, so a request runs to its
MAX_TOKENS: pass --max-tokens (e.g. 140 for Orpheus, about 1.7 s of audio) unless you want the model's maximum.
After an error or --timeout the audio received so far is still written, and said to be partial.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

import numpy as np

from voxbackend.stream_client import StreamOutcome, context_fields, make_inputs, stream_request, stream_text_pieces


def stdin_pieces(stream=None) -> Iterable[str]:
    """Each line read is a piece, sent as read (with its newline); EOF ends the utterance."""
    stream = stream or sys.stdin
    while True:
        line = stream.readline()
        if not line:
            return
        yield line


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    import soundfile as sf

    sf.write(str(path), audio, sample_rate, subtype="PCM_16")


def report(out: StreamOutcome) -> str:
    on_time = out.on_time()
    pct = f"{100.0 * sum(on_time) / len(on_time):.0f}%" if on_time else "-"
    ttfa = f"{1000 * out.ttfa_s:.0f} ms" if out.ttfa_s is not None else "-"
    xrt = out.audio_s / out.wall_s if out.wall_s > 0 else 0.0
    return (f"TTFA {ttfa} | chunks {len(out.chunks)} | stalls {out.stalls} (on-time chunks {pct}) | "
            f"audio {out.audio_s:.2f} s in {out.wall_s:.2f} s wall = {xrt:.2f}x real time "
            f"(audio s / wall s) | finish {out.finish_reason or out.error} | seed {out.seed}")


def add_request_args(ap: argparse.ArgumentParser) -> None:
    """The per-request flags both clients take: voice / speaker / context and the sampling fields."""
    ap.add_argument("--voice", default=None, help="orpheus: one of its voices")
    ap.add_argument("--speaker", type=int, default=None, help="csm: speaker id of TEXT (0-9)")
    ap.add_argument("--context-text", action="append", default=[], help="csm: a context segment's text (repeat)")
    ap.add_argument("--context-audio", action="append", default=[],
                    help="csm: a context segment's audio file, WAV/FLAC/OGG at any rate (repeat, one per text)")
    ap.add_argument("--context-speaker", action="append", type=int, default=[],
                    help="csm: a context segment's speaker (repeat; default: --speaker or 0 for each)")
    add_sampling_args(ap)
    ap.add_argument("--cfg-weight", type=float, help="chatterbox: classifier-free guidance weight, [0, 10]; 0 = off")
    ap.add_argument("--exaggeration", type=float, help="chatterbox: emotion exaggeration, [0, 2]")


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--min-p", type=float)
    ap.add_argument("--repetition-penalty", type=float)
    ap.add_argument("--max-tokens", type=int)


def sampling_fields(a: argparse.Namespace) -> dict[str, float | int | None]:
    """The sampling flags as request fields (None: the model's default)."""
    return {"TEMPERATURE": a.temperature, "TOP_P": a.top_p, "TOP_K": a.top_k, "MIN_P": a.min_p,
            "REPETITION_PENALTY": a.repetition_penalty, "CFG_WEIGHT": getattr(a, "cfg_weight", None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--model", default="orpheus",
                    help="a front model (orpheus, csm, qwen3_tts, cosyvoice2, chatterbox, chatterbox_turbo), its "
                    "<model>_engine, or qwen3_tts_text_stream / cosyvoice2_text_stream with --text-pieces or --stdin")
    ap.add_argument("--text", default="Hello there, this is a streaming speech server.")
    ap.add_argument("--text-pieces", default=None,
                    help='the text in pieces, "piece1|piece2|..." (a <model>_text_stream model): one Triton sequence')
    ap.add_argument("--piece-delay", type=float, default=0.0, help="seconds between pieces (--text-pieces)")
    ap.add_argument("--stdin", action="store_true",
                    help="text in pieces from stdin: each line read is a piece, EOF ends the utterance")
    add_request_args(ap)
    ap.add_argument("--reference-audio", default=None,
                    help="cosyvoice2, qwen3_tts Base: a clip of the voice to clone, WAV/FLAC/OGG at any rate")
    ap.add_argument("--reference-text", default=None, help="the transcript of --reference-audio")
    ap.add_argument("--format", default="pcm16", choices=("pcm16", "fp32"), help="AUDIO_FORMAT (front models)")
    ap.add_argument("--seed", type=int, help="sampling seed; default: the server draws one and returns it (printed)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default="out.wav", help="WAV file to write")
    a = ap.parse_args(argv)
    try:
        context = context_fields(a.context_text, a.context_audio, a.context_speaker, a.speaker or 0)
        reference = Path(a.reference_audio).read_bytes() if a.reference_audio else None
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if a.text_pieces is not None or a.stdin:
        if a.text_pieces is not None and a.stdin:
            ap.error("give --text-pieces or --stdin, not both")
        options = make_inputs(None, a.voice, a.format, speaker=a.speaker, context=context, batched=True,
                              reference_audio=reference, reference_text=a.reference_text,
                              exaggeration=a.exaggeration, **sampling_fields(a), MAX_TOKENS=a.max_tokens, SEED=a.seed)
        pieces = stdin_pieces() if a.stdin else a.text_pieces.split("|")
        out = stream_text_pieces(a.url, a.model, pieces, options, a.format, a.piece_delay, a.timeout)
    else:
        inputs = make_inputs(a.text, a.voice, a.format, speaker=a.speaker, context=context,
                             reference_audio=reference, reference_text=a.reference_text,
                             exaggeration=a.exaggeration, **sampling_fields(a), MAX_TOKENS=a.max_tokens, SEED=a.seed)
        out = stream_request(a.url, a.model, inputs, a.format, a.timeout)
    print(report(out) + (" | TTFA from the first piece" if a.text_pieces is not None or a.stdin else ""))
    for message in out.piece_errors:
        print(f"piece refused: {message}", file=sys.stderr)
    if out.chunks:  # after an error or a timeout too: what was received, said to be partial
        write_wav(a.out, out.audio, out.sample_rate or 24000)
        seconds = out.audio.size / (out.sample_rate or 24000)
        print(f"wrote {a.out} ({out.sample_rate} Hz, {seconds:.1f} s" + (", partial: the stream ended with the "
              "error below)" if out.error else ")"))
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    if not out.chunks:
        print("no audio received; nothing written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
