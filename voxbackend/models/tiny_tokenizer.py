"""The toy tokenizer of the tiny checkpoints: a byte-level BPE trained on a fixed English text, laid out like
Llama-3's (128000 regular ids, then its special ids) plus Orpheus' custom audio tokens. Tiny Orpheus and CSM
checkpoints carry it; CORPUS also trains the other models' toy tokenizers."""
from __future__ import annotations

import json
from pathlib import Path

ORPHEUS_VOCAB = 156940
BOS_ID, EOT_ID = 128000, 128009
NUM_REGULAR = 128000          # ids below this are ordinary BPE tokens
CUSTOM_BASE = 128256          # <custom_token_N> = CUSTOM_BASE + N
NUM_CUSTOM = ORPHEUS_VOCAB - CUSTOM_BASE  # 28684


# Our own training text for the toy BPE: plain English, fixed here so the tokenizer never changes.
CORPUS = """\
Hello world. Hello there, how are you doing today? I am doing well, thank you for asking.
The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill.
Tara, Leah, Jess, Leo, Dan, Mia, Zac and Zoe are the voices that read the stories aloud.
A streaming server sends the first audio chunk as soon as it is ready, so the listener can start playing.
The weather this morning was cold and grey, but by the afternoon the sun came out over the hills.
She said that the train would arrive at seven, and that we should wait for her near the station.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy to say.
Please read this sentence slowly and clearly, with a short pause after every comma and full stop.
When the music stopped, everyone in the room turned around to see who had opened the heavy door.
It is important to test every part of a system, from the smallest function to the whole service.
I think that we should go for a walk in the park, and then have some tea and a slice of cake.
The children laughed and played in the garden until their mother called them in for dinner.
Good morning! Good evening! Good night, and sleep well. See you tomorrow, my friend.
Can you tell me the way to the library? Turn left at the corner and walk straight for two blocks.
Speech models turn text into sound, one small piece at a time, faster than a person can speak.
"""


def _llama3_special_tokens() -> list[str]:
    # Llama-3 ids 128000..128255; the named ones sit where Meta put them, the rest are reserved_special_token_N
    named = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
             128007: "<|end_header_id|>", 128009: "<|eot_id|>"}
    out, n = [], 0
    for i in range(128000, CUSTOM_BASE):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{n}|>")
            n += 1
    return out


def build_tokenizer():
    """Byte-level BPE trained on CORPUS, padded to 128000 regular ids, then Llama-3 + Orpheus special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    base.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    state = json.loads(base.to_str())["model"]
    vocab: dict[str, int] = dict(state["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    # filler ids: no merge ever produces these strings, so they are unreachable by encoding
    for i in range(len(vocab), NUM_REGULAR):
        vocab[f"<filler_{i}>"] = i
    assert len(vocab) == NUM_REGULAR and max(vocab.values()) == NUM_REGULAR - 1

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    specials = _llama3_special_tokens() + [f"<custom_token_{n}>" for n in range(NUM_CUSTOM)]
    tok.add_special_tokens(specials)  # ids are assigned in order from 128000
    assert tok.get_vocab_size() == ORPHEUS_VOCAB
    assert tok.token_to_id("<|eot_id|>") == EOT_ID and tok.token_to_id("<custom_token_4>") == 128260
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
        special_tokens=[("<|begin_of_text|>", BOS_ID)])
    return tok


def write_tokenizer(out: Path) -> None:
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "model_input_names": ["input_ids", "attention_mask"],
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, indent=2))
