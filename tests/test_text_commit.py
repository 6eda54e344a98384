"""The commit rule for text pieces cut anywhere: the ids committed piece by piece are exactly the whole text's ids."""
from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from voxbackend.models.text_tokens import TextTokenizer
from voxbackend.triton.text_commit import TextCommitter

# Qwen2 / Qwen3 tokenizer.json: NFC, this split (with a lookahead), then byte-level without its own regex
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "Hello there, how are you doing today? I'm fine, thanks; we'll see.",
    "The quick brown fox jumps over the lazy dog 12345 times!!",
    "Café au lait, naïve résumé, Straße, Ærøskøbing.",
    "日本語のテキストと中文文本，还有 emoji 🙂🎉 mixed in.",
    "Line one\nLine two\n\n  indented   spaces\tand tabs...",
]
TEXTS = [
    "Hello there, how are you doing today? I'm fine, thanks!",
    "She said: \"don't wait\" -- then left at 7:45pm...   Really?!",
    "Cafe\u0301 au lait and cafe\u0301s, na\u00efve re\u0301sume\u0301.",
    "日本語のテキスト、中文文本。🙂🎉 ok",
    "Numbers 3.14159 and 2,718 and 1e-9;\n\nnew paragraph\n  with  spaces  \tand tabs",
    "  leading spaces and trailing spaces   ",
]


def train(pre, normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def tokenizer(request) -> TextTokenizer:
    if request.param == "qwen2":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return TextTokenizer(train(pre, normalizers.NFC()))
    return TextTokenizer(train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)))


def pieces_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def committed_ids(tok: TextTokenizer, pieces: list[str]) -> list[int]:
    c = TextCommitter(tok, tok.encode)
    ids = [i for p in pieces for i in c.add(p)]
    return ids + c.close()


@pytest.mark.parametrize("text", TEXTS)
def test_random_boundaries_give_the_whole_texts_ids(tokenizer, text):
    rng = random.Random(hash(text) & 0xFFFF)
    whole = tokenizer.encode(tokenizer.normalize(text))
    assert whole == tokenizer.encode(text)
    for _ in range(150):
        cuts = rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))
        assert committed_ids(tokenizer, pieces_at(text, cuts)) == whole, pieces_at(text, cuts)
    # one character per piece: every boundary at once
    assert committed_ids(tokenizer, list(text)) == whole


def test_the_rule_is_needed(tokenizer):
    """Encoding each piece on its own (the obvious rule) gives other ids for these cuts: the test above can fail."""
    text = "Hello there, how are you?"
    pieces = pieces_at(text, [3, 8, 13])  # "Hel|lo th|ere, |how are you?"
    naive = [i for p in pieces for i in tokenizer.encode(p)]
    assert naive != tokenizer.encode(text)
    assert committed_ids(tokenizer, pieces) == tokenizer.encode(text)


def test_the_last_pre_token_waits_for_the_next_piece(tokenizer):
    c = TextCommitter(tokenizer, tokenizer.encode)
    assert c.add("Hel") == []  # may become "Hello"
    assert c.add("lo") == []
    first = c.add(" wor")  # "Hello" is final now; " wor" is not
    assert first == tokenizer.encode("Hello") and c.committed == "Hello"
    assert c.add("ld. ") != [] and c.committed == "Hello world."
    assert c.close() == tokenizer.encode(" ")
    assert c.ids == tokenizer.encode("Hello world. ")


def test_an_accent_in_the_next_piece_joins_its_letter():
    tok = TextTokenizer(train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), normalizers.NFC()))
    text = "cafe\u0301 ok"
    assert committed_ids(tok, ["cafe", "\u0301 ok"]) == tok.encode(text) == tok.encode("caf\u00e9 ok")


def test_a_normalizer_that_is_not_prefix_stable_is_refused():
    tok = TextTokenizer(train(pre_tokenizers.Metaspace(), normalizers.Sequence(
        [normalizers.NFC(), normalizers.Prepend("\u2581")])))
    with pytest.raises(ValueError, match="Prepend"):
        TextCommitter(tok, tok.encode)


@pytest.mark.parametrize("text", TEXTS)
def test_the_head_for_prepare_plus_the_rest_is_the_committed_ids(tokenizer, text):
    rng = random.Random(7)
    for _ in range(40):
        c = TextCommitter(tokenizer, tokenizer.encode)
        for p in pieces_at(text, rng.sample(range(1, len(text)), min(4, len(text) - 1))):
            c.add(p)
        head, rest = c.head()
        assert c.committed.startswith(head)
        assert tokenizer.encode(head) + rest == c.ids


def test_a_newline_run_before_a_word_is_not_the_head(tokenizer):
    """"Hi\n\n" + "there": in the whole text the newlines are two pre-tokens, encoded alone they are one."""
    c = TextCommitter(tokenizer, tokenizer.encode)
    c.add("Hi\n\nthe")
    assert c.committed == "Hi\n\n"
    head, rest = c.head()
    assert tokenizer.encode(head) + rest == c.ids == tokenizer.encode("Hi\n\nthere")[:len(c.ids)]
