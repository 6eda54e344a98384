"""prompts.txt -> perf_analyzer --input-data JSON files (one entry per prompt; PA cycles through them).

Format (perf_analyzer "real input data"): {"data": [{"TEXT": {"content": ["..."], "shape": [1]}, ...}, ...]}.
BYTES inputs carry their strings in "content"; numeric inputs carry numbers and PA casts them to the
dtype the model declares, so the JSON does not fix MAX_TOKENS's dtype.

    python perf/data/make_inputs.py            # regenerates the committed files
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_prompts(path: Path) -> list[str]:
    lines = (ln.strip() for ln in path.read_text(encoding="utf-8").splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def pa_entries(prompts: list[str], voice: str | None = None, max_tokens: int | None = None) -> dict:
    def tensor(v): return {"content": [v], "shape": [1]}
    data = []
    for text in prompts:
        e = {"TEXT": tensor(text)}
        if voice is not None:
            e["VOICE"] = tensor(voice)
        if max_tokens is not None:
            e["MAX_TOKENS"] = tensor(max_tokens)
        data.append(e)
    return {"data": data}


def write(path: Path, obj: dict) -> None:
    # One entry per line keeps diffs of the committed files readable.
    body = ",\n  ".join(json.dumps(e, ensure_ascii=False) for e in obj["data"])
    path.write_text('{"data": [\n  ' + body + "\n]}\n", encoding="utf-8")
    print(f"wrote {path} ({len(obj['data'])} entries)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts.txt")
    ap.add_argument("--out", type=Path, default=None, help="write one custom file instead of the defaults")
    ap.add_argument("--voice", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    a = ap.parse_args(argv)
    prompts = load_prompts(a.prompts)
    if a.out is not None:
        write(a.out, pa_entries(prompts, a.voice, a.max_tokens))
        return
    # Committed defaults: server-side defaults, and a bounded variant for CPU runs
    # (256 Orpheus tokens ~ 3 s of audio at 7 tokens per 85 ms frame).
    write(HERE / "pa_orpheus.json", pa_entries(prompts))
    write(HERE / "pa_orpheus_max256.json", pa_entries(prompts, max_tokens=256))


if __name__ == "__main__":
    main()
