"""Child process of the API: each model's voices and sample rate, from its front end.

stdin: JSON {model name: its preprocess config parameters}; stdout (last line): JSON {model name: {"voices",
"sample_rate", "guidance"} or {"error"}}. A child, so the API process never imports torch or loads a tokenizer.
"""
from __future__ import annotations

import json
import sys


def main() -> int:
    from voxbackend.triton.loading import load_frontend

    answers = {}
    for name, params in json.loads(sys.stdin.read()).items():
        try:
            frontend = load_frontend(params, in_process=True)
            answers[name] = {"voices": list(frontend.voices), "sample_rate": int(frontend.spec.sample_rate),
                             "guidance": bool(frontend.spec.guidance)}
        except Exception as e:  # one model's failure must not hide the others' voices
            answers[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
