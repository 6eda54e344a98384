"""A deterministic random-weight CosyVoice2-0.5B checkpoint folder, in the official layout.

    python -m voxbackend.models.cosyvoice2.tiny --out DIR [--seed N]

writes DIR/llm.pt (the upstream Qwen2LM state dict: llm_embedding, llm.model.* of a tiny Qwen2ForCausalLM,
llm_decoder, speech_embedding), DIR/CosyVoice-BlankEN/{config.json,tokenizer.json}, the detokenizer
(flow.pt, hift.pt, token2wav.json; voxbackend.models.cosyvoice2.tiny_codec with the real 6561-token vocabulary),
the cloning
front end (speech_tokenizer_v2.safetensors, campplus.safetensors, frontend.json) and one named voice,
DIR/voices/<DEFAULT_VOICE>.safetensors, cloned by that front end from a synthetic clip.

Weights are at unit scale and the speech head's logits spread over tens of units, so greedy decoding does not
meet near-ties that float rounding could flip. The end id's bias is raised so that it competes with speech
tokens (utterances end on their own), and the two fill ids, which the real model emits only in bistream mode,
are pushed out of reach.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from voxbackend.models.cosyvoice2.model import QWEN_FOLDER, SPEECH_ROWS, SPEECH_TOKENS
from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.tiny_tokenizer import CORPUS
from voxbackend.models.cosyvoice2.tiny_codec import write_tiny_codec
from voxbackend.models.cosyvoice2.tiny_cloning import load_tiny_cloner

QWEN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True)
TEXT_VOCAB = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "[laughter]")
HEAD_LOGIT_STD = 10.0
END_BIAS = 26.0  # the end id's logit bias: high enough to win now and then
DEFAULT_VOICE = "tiny_speaker"
VOICE_TRANSCRIPT = "Hello, this is a short sample of my voice."


def build_tokenizer():
    """Byte-level BPE trained on the Orpheus tiny corpus, plus a few of CosyVoice2's added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() <= TEXT_VOCAB
    return tok


def llm_state_dict(seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Qwen config.json dict, the Qwen2LM state dict under upstream names)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=TEXT_VOCAB, **QWEN)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        qwen = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    hidden = QWEN["hidden_size"]
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.75)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # q/k/v biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    state = {f"llm.model.{k}": v.clone() for k, v in qwen.state_dict().items()}
    bias = torch.randn(SPEECH_ROWS, generator=g)
    bias[SPEECH_TOKENS] = END_BIAS
    bias[SPEECH_TOKENS + 1:] = -1e4
    state.update({
        "llm_embedding.weight": torch.randn(2, hidden, generator=g),
        "speech_embedding.weight": torch.randn(SPEECH_ROWS, hidden, generator=g),
        "llm_decoder.weight": torch.randn(SPEECH_ROWS, hidden, generator=g) * HEAD_LOGIT_STD * hidden**-0.5,
        "llm_decoder.bias": bias,
    })
    return config.to_dict(), state


def voice_clip(seconds: float = 2.0, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A voiced-sounding synthetic clip: a gliding tone with harmonics and some noise."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(0.2 / k * np.sin(k * phase) for k in range(1, 6))
    x = x + 0.02 * np.random.default_rng(seed).standard_normal(t.size)
    return x.astype(np.float32)


def write_tiny_cosyvoice2(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    qwen_dir = out / QWEN_FOLDER
    qwen_dir.mkdir(exist_ok=True)
    config, state = llm_state_dict(seed)
    (qwen_dir / "config.json").write_text(json.dumps(config, indent=1))
    build_tokenizer().save(str(qwen_dir / "tokenizer.json"))
    torch.save(state, out / "llm.pt")
    write_tiny_codec(out, seed=seed, vocab_size=SPEECH_TOKENS)
    frontend = load_tiny_cloner(out, seed=seed)
    frontend.save_voice(DEFAULT_VOICE, frontend.clone(voice_clip(seed=seed), 16000, VOICE_TRANSCRIPT))
    return out


def ensure_default_cosyvoice2(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny CosyVoice2 the `cosyvoice2` Triton models serve when no checkpoint is configured,
    built once into `<VOXBACKEND_CACHE>-cosyvoice2` through a temporary folder and an atomic rename."""
    root = cache_root("-cosyvoice2") if root is None else root
    return build_once(root, lambda out: write_tiny_cosyvoice2(out / "cosyvoice2", seed=0)) / "cosyvoice2", None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_cosyvoice2(args.out, args.seed))


if __name__ == "__main__":
    main()
