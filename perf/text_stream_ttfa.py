"""Time to first audio of text sent in pieces, measured from the first piece, next to the whole text.

    python perf/text_stream_ttfa.py --model qwen3_tts --runs 5 --piece-delay 0.2   # serves the tiny checkpoint
    python perf/text_stream_ttfa.py --url localhost:8001 --model qwen3_tts          # against a running server

Cases, one after another (one stream at a time), the same text and seed each time:
whole (the `<model>` model, TTFA from the request), one piece (START and END on one request of
`<model>_text_stream`), word pieces (every piece ends after a space: the first word commits at once) and
mid-word pieces (the first piece ends inside a word: nothing starts until the second piece, one piece delay
later). Prints the median, min and max TTFA per case, with the provenance of the run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from voxbackend.stream_client import make_inputs, stream_request, stream_text_pieces  # noqa: E402
from perf import provenance  # noqa: E402

TEXT = "Hello there, how are you doing today? I'm fine, thanks."
WORD_PIECES = ["Hello ", "there, ", "how are ", "you doing ", "today? ", "I'm fine, ", "thanks."]
MID_WORD_PIECES = ["Hel", "lo the", "re, how", " are you do", "ing today? I'", "m fine, th", "anks."]


def served_repository(model: str, dest: Path) -> Path:
    from voxbackend.deploy import configs

    return configs.write_repository(dest, {"max_batch": "4"}, models=[model])


def measure(url: str, model: str, runs: int, delay: float, fields: dict) -> dict[str, list[float]]:
    stream = f"{model}_text_stream"
    options = lambda: make_inputs(None, batched=True, **fields)  # noqa: E731
    cases = {
        "whole (front model)": lambda: stream_request(url, model, make_inputs(TEXT, **fields), timeout=300),
        "one piece": lambda: stream_text_pieces(url, stream, [TEXT], options(), timeout=300),
        f"word pieces, {delay:g} s apart": lambda: stream_text_pieces(url, stream, WORD_PIECES, options(),
                                                                      piece_delay=delay, timeout=300),
        f"mid-word pieces, {delay:g} s apart": lambda: stream_text_pieces(url, stream, MID_WORD_PIECES, options(),
                                                                          piece_delay=delay, timeout=300),
    }
    cases["whole (front model)"]()  # warm-up: first-call costs are not the case's
    ttfa: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, run in cases.items():
            out = run()
            if out.error or out.ttfa_s is None:
                raise SystemExit(f"{name}: {out.error or 'no audio'}")
            ttfa[name].append(out.ttfa_s)
    return ttfa


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server's gRPC address; default: serve the model's tiny checkpoint")
    ap.add_argument("--model", default="qwen3_tts")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--piece-delay", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=40)
    a = ap.parse_args(argv)
    fields = {"SEED": 7, "MAX_TOKENS": a.max_tokens}
    if a.url:
        ttfa = measure(a.url, a.model, a.runs, a.piece_delay, fields)
    else:
        from voxbackend.deploy.server import TritonServer

        with tempfile.TemporaryDirectory() as tmp:
            repo = served_repository(a.model, Path(tmp) / "model_repository")
            with TritonServer(repo) as server:
                ttfa = measure(server.grpc_url, a.model, a.runs, a.piece_delay, fields)
    info = provenance.collect()
    print("\n".join(provenance.markdown_lines(info)))
    print(f"\nmodel {a.model} (tiny random checkpoint unless --url serves another), one stream at a time, "
          f"{a.runs} runs per case, MAX_TOKENS {a.max_tokens}, seed 7\n")
    print("| case | TTFA median | min | max |\n|---|---|---|---|")
    for name, values in ttfa.items():
        print(f"| {name} | {1000 * statistics.median(values):.0f} ms | {1000 * min(values):.0f} ms | "
              f"{1000 * max(values):.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
