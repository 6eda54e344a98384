"""User text can never become a control token: every added/special token string the tokenizer knows, spelled out
in the text, is tokenized as plain text in every model that tokenizes text (Orpheus, CSM; the token-only model
takes ids, not text). The prompt template's own control ids are the only ones in the prompt."""
from __future__ import annotations

import numpy as np
import pytest

from voxbackend.models.csm.model import CsmFrontend
from voxbackend.models.orpheus.model import OrpheusFrontend

CHUNK_CHARS = 400  # a few hundred characters per prompt: far inside every length limit
BOS_EOS = {"<|begin_of_text|>", "<|end_of_text|>"}


def added_token_texts(tokenizer) -> list[str]:
    strings = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    assert len(strings) > 200, "the tiny tokenizers carry the Llama-3 specials (and Orpheus' custom tokens)"
    return strings


def chunks(strings: list[str]) -> list[str]:
    out, cur = [], ""
    for s in strings:
        if cur and len(cur) + len(s) > CHUNK_CHARS:
            out.append(cur)
            cur = ""
        cur += s
    return out + [cur]


def plain_like(text: str) -> str:
    return ("plain words " * (len(text) // 12 + 1))[: len(text)]


@pytest.fixture(scope="module")
def orpheus(tiny_orpheus):
    return OrpheusFrontend(*tiny_orpheus)


@pytest.fixture(scope="module")
def csm(tiny_csm):
    return CsmFrontend(tiny_csm)


def test_orpheus_text_never_becomes_a_control_token(orpheus):
    first_added = orpheus.text_tokenizer.first_added_id
    assert orpheus.tokenizer.encode("<|eot_id|><custom_token_4>", add_special_tokens=False).ids == [128009, 128260]
    plain = orpheus.prepare("Hello there.", "leo")
    template = [i for i in plain if i >= first_added]
    assert template == [128259, 128000, 128009, 128260, 128261, 128257]  # the official template's control ids
    strings = added_token_texts(orpheus.tokenizer)
    assert "<|eot_id|>" in strings and "<custom_token_4>" in strings
    for text in chunks(strings):
        for voice in ("leo", None):
            ids = orpheus.prepare(text, voice)
            controls = [i for i in ids if i >= first_added]
            assert controls == template, text[:80]
            assert len(controls) == sum(i >= first_added for i in orpheus.prepare(plain_like(text), voice))
            # the user's part decodes back to the literal text
            assert orpheus.text_tokenizer.decode(ids[2:-4]) == f"{voice or 'tara'}: {text}"


def test_orpheus_plain_text_is_tokenized_as_before(orpheus):
    for text in ("Hello world.", "Numbers like one, two, three!", "héllo <b>wörld</b> < | >"):
        ids = orpheus.prepare(text, "mia")
        assert ids[1:-4] == orpheus.tokenizer.encode(f"mia: {text}").ids  # <|begin_of_text|> + text, as HF does


def _text_ids(rows: list[list[int]]) -> list[int]:
    return [r[-1] for r in rows if r[-1] >= 0]


def test_csm_text_and_context_text_never_become_control_tokens(csm):
    first_added = csm.text_tokenizer.first_added_id
    codes = np.zeros((2, csm.num_codebooks), np.int64)
    plain_rows = csm.prepare("Hello.", 1, context=[{"text": "Before.", "speaker": 0, "codes": codes}])
    template = [i for i in _text_ids(plain_rows) if i >= first_added]
    assert template == [csm.bos, csm.eos, csm.bos, csm.eos]
    strings = added_token_texts(csm.tokenizer)
    assert BOS_EOS <= set(strings)
    for text in chunks(strings):
        rows = csm.prepare(text, 2, context=[{"text": text, "speaker": 0, "codes": codes}])
        ids = _text_ids(rows)
        assert [i for i in ids if i >= first_added] == template, text[:80]
        plain = _text_ids(csm.prepare(plain_like(text), 2, context=[{"text": plain_like(text), "speaker": 0,
                                                                     "codes": codes}]))
        assert sum(i >= first_added for i in plain) == len(template)
        last = ids[ids.index(csm.bos, 1) + 1: -1]  # the final segment's text, between its bos and eos
        assert csm.text_tokenizer.decode(last) == f"[2]{text}"

