"""A deterministic random-weight GLM-4-Voice checkpoint folder, in the official layout.

    python -m voxbackend.models.glm4_voice.tiny --out DIR [--seed N]

writes glm-4-voice-9b's files into DIR: config.json (`model_type: chatglm`), model.safetensors (the LM under GLM-4's
own names, `transformer.`), tokenizer.model (tiktoken ranks of a toy byte-level BPE) and tokenizer_config.json
(GLM-4's control tokens after the ranks, then GLM-4-Voice's `<|begin_of_audio|>`, `<|end_of_audio|>` and the 16384
`<|audio_N|>`); and inside it the other two official folders, DIR/glm-4-voice-tokenizer/ (tiny_tokenizer.py) and
DIR/glm-4-voice-decoder/ (tiny_decoder.py).

Weights are at unit scale, so greedy decoding does not meet near-ties that float rounding could flip. The head's
rows of control ids and of the toy vocabulary's fillers are zero (a random reply then runs to its length limit rather
than stopping at once), and its text rows are scaled up so that replies mix text and speech ids.
"""
from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.glm4_voice.chat import CONTROL_TOKENS, SPEECH_CODES
from voxbackend.models.glm4_voice.model import DECODER_FOLDER, TOKENIZER_FOLDER
from voxbackend.models.glm4_voice.tiny_decoder import write_tiny_decoder
from voxbackend.models.glm4_voice.tiny_tokenizer import write_tiny_tokenizer
from voxbackend.models.tiny_tokenizer import CORPUS

TEXT_VOCAB = 1024  # the toy BPE's ranks
VOICE_TOKENS = ("<|begin_of_audio|>", "<|end_of_audio|>")
AUDIO_OFFSET = TEXT_VOCAB + len(CONTROL_TOKENS) + len(VOICE_TOKENS)
VOCAB = -(-(AUDIO_OFFSET + SPEECH_CODES) // 128) * 128  # padded_vocab_size, as GLM-4 pads to a multiple of 128
# the text rows of the head, scaled up: 1024 text ids against 16384 speech ids would leave a reply almost all speech
TEXT_HEAD_SCALE = 1.6
CONFIG = dict(architectures=["ChatGLMModel"], model_type="chatglm", add_bias_linear=False, add_qkv_bias=True,
              apply_residual_connection_post_layernorm=False, attention_dropout=0.0, ffn_hidden_size=128,
              hidden_size=64, kv_channels=16, layernorm_epsilon=1.5625e-07, multi_query_attention=True,
              multi_query_group_num=2, num_attention_heads=4, num_layers=2, original_rope=True, padded_vocab_size=VOCAB,
              post_layer_norm=True, rmsnorm=True, rope_ratio=1, seq_length=4096, tie_word_embeddings=False,
              torch_dtype="float32", eos_token_id=[TEXT_VOCAB, TEXT_VOCAB + 7, TEXT_VOCAB + 9],
              pad_token_id=TEXT_VOCAB)


def byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-ins for bytes) -> the byte each stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def toy_ranks() -> dict[bytes, int]:
    """A byte-level BPE trained on the tiny corpus, as tiktoken ranks: a token's id is its merge's rank."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    chars = byte_level_chars()
    ranks = {bytes(chars[c] for c in token): i for token, i in tok.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(len(ranks)))
    # fillers up to TEXT_VOCAB: 0xF8 never occurs in UTF-8, so no text ever merges into them
    for i in range(len(ranks), TEXT_VOCAB):
        ranks[b"\xf8" + i.to_bytes(2, "big")] = i
    return ranks


def write_tokenizer(out: Path) -> int:
    """tokenizer.model and tokenizer_config.json; returns the ids the toy BPE uses (the fillers after them)."""
    ranks = toy_ranks()
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(),
                                                                                    key=lambda kv: kv[1])]
    (out / "tokenizer.model").write_text("\n".join(lines) + "\n")
    names = [*CONTROL_TOKENS, *VOICE_TOKENS, *(f"<|audio_{i}|>" for i in range(SPEECH_CODES))]
    added = {str(TEXT_VOCAB + i): {"content": name, "special": True} for i, name in enumerate(names)}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLM4Tokenizer", "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer",
                                                                                None]},
        "added_tokens_decoder": added, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "padding_side": "left", "clean_up_tokenization_spaces": False, "model_max_length": 128000}, indent=1))
    return sum(not token.startswith(b"\xf8") or len(token) == 1 for token in ranks)


def lm_state_dict(seed: int, used_ids: int) -> dict[str, torch.Tensor]:
    """The LM under GLM-4's own names at unit scale; the head's rows of fillers and control ids zero, its text rows
    scaled up."""
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    hidden, ffn, head_dim = c["hidden_size"], c["ffn_hidden_size"], c["kv_channels"]
    qkv = (c["num_attention_heads"] + 2 * c["multi_query_group_num"]) * head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    def norm() -> torch.Tensor:
        return torch.rand(hidden, generator=g) * 0.5 + 0.75

    state = {"transformer.embedding.word_embeddings.weight": torch.randn(VOCAB, hidden, generator=g),
             "transformer.encoder.final_layernorm.weight": norm()}
    for i in range(c["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        state.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attention.query_key_value.weight": matrix(qkv, hidden),
            p + "self_attention.query_key_value.bias": torch.randn(qkv, generator=g) * 0.1,
            p + "self_attention.dense.weight": matrix(hidden, c["num_attention_heads"] * head_dim),
            p + "mlp.dense_h_to_4h.weight": matrix(2 * ffn, hidden),
            p + "mlp.dense_4h_to_h.weight": matrix(hidden, ffn),
        })
    head = matrix(VOCAB, hidden)
    head[:TEXT_VOCAB] *= TEXT_HEAD_SCALE
    head[used_ids:AUDIO_OFFSET] = 0.0
    head[AUDIO_OFFSET + SPEECH_CODES:] = 0.0
    state["transformer.output_layer.weight"] = head
    state["transformer.rotary_pos_emb.inv_freq"] = torch.ones(head_dim // 4)  # a buffer the official file carries
    return state


def write_tiny_glm4_voice(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    used_ids = write_tokenizer(out)
    save_file({k: v.contiguous() for k, v in lm_state_dict(seed, used_ids).items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    write_tiny_tokenizer(out / TOKENIZER_FOLDER, seed + 1)
    write_tiny_decoder(out / DECODER_FOLDER, seed + 2)
    return out


def ensure_default_glm4_voice(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny GLM-4-Voice, built once into `<VOXBACKEND_CACHE>-glm4_voice`."""
    root = cache_root("-glm4_voice") if root is None else root
    return build_once(root, lambda out: write_tiny_glm4_voice(out / "glm4_voice", seed=0)) / "glm4_voice", None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_tiny_glm4_voice(args.out, args.seed))


if __name__ == "__main__":
    main()
