"""Step-Audio 2's chat template: a conversation -> the LM's prompt ids, with a FEATURE row for every
`<audio_patch>` placeholder (the audio encoder's rows go there).

Each turn is `<|BOT|>{role}\\n`, its content, then `<|EOT|>` (the user's role is called `human`). Content is text,
a 16 kHz clip (`<audio_start>`, one placeholder per adapter row of each 25 s piece, `<audio_end>`) or ids (a prior
reply as the model said it). A spoken reply is asked for by opening the assistant's turn with `<tts_start>` (the
id list [tts_start] as its content). Upstream tokenizes each piece of text on its own and joins the ids, so BPE never
merges across pieces; so does this.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer

from voxbackend.models.base import FEATURE
from voxbackend.models.step_audio2.audio_encoder import pieces, placeholder_count
from voxbackend.models.text_tokens import TextTokenizer

ROLES = {"system": "system", "user": "human", "human": "human", "assistant": "assistant"}


@dataclass
class Turn:
    role: str  # system, user (human) or assistant
    # a string (upstream's plain form: one piece with the turn's header), or a list of text, 16 kHz float clips and
    # id lists
    content: str | list[str | np.ndarray | list[int]]
    ends: bool = True  # False: the turn stays open for the model (the assistant's turn being asked for)


@dataclass
class ChatPrompt:
    ids: list[int]  # FEATURE at each placeholder row
    mels: list[torch.Tensor] = field(default_factory=list)  # the spectrogram of each audio piece, in prompt order


class ChatTemplate:
    """Control ids are added in code; text, the user's included, goes through TextTokenizer, so text that spells
    out `<|EOT|>` stays text (upstream tokenizes the whole string, where it would end the turn)."""

    def __init__(self, tokenizer: Tokenizer):
        self.text = TextTokenizer(tokenizer)

        def token(name: str) -> int:
            tid = tokenizer.token_to_id(name)
            if tid is None:
                raise ValueError(f"the tokenizer has no {name} token: not a Step-Audio 2 tokenizer")
            return tid

        self.bot, self.eot = token("<|BOT|>"), token("<|EOT|>")
        self.audio_start, self.audio_end = token("<audio_start>"), token("<audio_end>")
        self.tts_start = token("<tts_start>")

    def render(self, turns: list[Turn]) -> ChatPrompt:
        prompt = ChatPrompt([])
        for turn in turns:
            role = ROLES[turn.role]
            if isinstance(turn.content, str):  # one piece: header and text
                prompt.ids += [self.bot, *self.text.encode(f"{role}\n{turn.content}")]
            else:
                prompt.ids += [self.bot, *self.text.encode(f"{role}\n")]
                for item in turn.content:
                    if isinstance(item, str):
                        prompt.ids += self.text.encode(item)
                    elif isinstance(item, np.ndarray):
                        for mel in pieces(torch.from_numpy(np.ascontiguousarray(item, dtype=np.float32))):
                            rows = placeholder_count(mel.shape[-1])
                            prompt.ids += [self.audio_start, *[FEATURE] * rows, self.audio_end]
                            prompt.mels.append(mel)
                    else:
                        prompt.ids += [int(i) for i in item]
            if turn.ends:
                prompt.ids.append(self.eot)
        return prompt
