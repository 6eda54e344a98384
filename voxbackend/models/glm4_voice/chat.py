"""GLM-4-Voice's text tokenizer and chat template.

The tokenizer is GLM-4's: `tokenizer.model` holds tiktoken's byte-level BPE ranks (one `base64(token) rank` line
each) under GLM-4's pre-tokenizer pattern; its 14 control tokens take the ids after the last rank, and
`tokenizer_config.json` adds GLM-4-Voice's own (`<|begin_of_audio|>`, `<|end_of_audio|>` and the 16384
`<|audio_N|>` speech tokens) at the ids it gives them.

The prompt is upstream's web demo's: `[gMASK]<sop>`, then `<|system|>\\n{system}`, each user turn as
`<|user|>\\n{text}` or `<|user|>\\n<|begin_of_audio|>{speech tokens}<|end_of_audio|>`, each assistant turn as
`<|assistant|>streaming_transcription\\n{what it said}`, and the turn asked for opened with
`<|assistant|>streaming_transcription\\n`. Upstream writes that as one string and lets the tokenizer find the control
tokens in it; here they are added in code and text only ever becomes text ids, so a user who types `<|user|>`
cannot end the turn. Each text piece is encoded on its own, as the control tokens split upstream's string.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from voxbackend.models.base import FEATURE

PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL_TOKENS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                  "<|end_of_video|>")
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # the model ends its turn by opening the next
SPEECH_CODES = 16384
# upstream's system prompts (web_demo.py), by what the user's turn is; GLM-4-Voice answers in this interleave
SPEECH_SYSTEM = ("User will provide you with a speech instruction. Do it step by step. First, think about the "
                 "instruction and respond in a interleaved manner, with 13 text token followed by 26 audio tokens. ")
TEXT_SYSTEM = ("User will provide you with a text instruction. Do it step by step. First, think about the "
               "instruction and respond in a interleaved manner, with 13 text token followed by 26 audio tokens.")
REPLY_HEADER = "streaming_transcription\n"


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class GlmTokenizer:
    """Text <-> ids with tiktoken; control and speech tokens by name."""

    def __init__(self, folder: str | Path):
        import tiktoken

        folder = Path(folder)
        if not (folder / "tokenizer.model").is_file():
            raise FileNotFoundError(f"no tokenizer.model in {folder} (GLM-4's tiktoken ranks)")
        ranks = read_ranks(folder / "tokenizer.model")
        self.first_added_id = len(ranks)  # ids from here on are control or speech tokens
        self.ids = {name: len(ranks) + i for i, name in enumerate(CONTROL_TOKENS)}
        config = folder / "tokenizer_config.json"
        added = json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
        self.ids.update({entry["content"]: int(i) for i, entry in added.items()})
        self.names = {i: name for name, i in self.ids.items()}
        self._encoding = tiktoken.Encoding("glm4", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        """Text ids as UTF-8 (bytes split across ids read as U+FFFD until completed); named tokens by name."""
        out, pending = [], []
        for i in ids:
            if i < self.first_added_id:
                pending.append(i)
                continue
            if pending:
                out.append(self._encoding.decode(pending, errors="replace"))
                pending = []
            out.append(self.names.get(i, ""))
        if pending:
            out.append(self._encoding.decode(pending, errors="replace"))
        return "".join(out)

    def token(self, name: str) -> int:
        if name not in self.ids:
            raise ValueError(f"the tokenizer has no {name} token: not a GLM-4-Voice tokenizer")
        return self.ids[name]


@dataclass
class Turn:
    role: str  # system, user or assistant
    text: str | None = None
    speech_tokens: int = 0  # a user turn's clip: this many FEATURE rows (the speech tokenizer's ids go there)


class ChatTemplate:
    def __init__(self, tokenizer: GlmTokenizer):
        self.text = tokenizer
        t = tokenizer.token
        self.prefix = [t("[gMASK]"), t("<sop>")]
        self.roles = {role: t(f"<|{role}|>") for role in ("system", "user", "assistant")}
        self.begin_audio, self.end_audio = t("<|begin_of_audio|>"), t("<|end_of_audio|>")
        self.audio_offset = t("<|audio_0|>")
        if t(f"<|audio_{SPEECH_CODES - 1}|>") != self.audio_offset + SPEECH_CODES - 1:
            raise ValueError(f"the tokenizer's <|audio_N|> ids are not {SPEECH_CODES} consecutive ids")
        self.stop_ids = tuple(t(name) for name in STOP_TOKENS)

    def render(self, turns: list[Turn]) -> list[int]:
        """The conversation up to an opened assistant turn; FEATURE where a clip's speech tokens go."""
        ids = list(self.prefix)
        for turn in turns:
            ids.append(self.roles[turn.role])
            if turn.role == "assistant":
                ids += self.text.encode(REPLY_HEADER + (turn.text or ""))
                continue
            if turn.speech_tokens:  # upstream: "\n<|begin_of_audio|>...<|end_of_audio|>", then the text if any
                ids += [*self.text.encode("\n"), self.begin_audio, *[FEATURE] * turn.speech_tokens, self.end_audio]
                if turn.text:
                    ids += self.text.encode("\n" + turn.text)
            else:
                ids += self.text.encode("\n" + (turn.text or ""))
        return ids + [self.roles["assistant"], *self.text.encode(REPLY_HEADER)]
