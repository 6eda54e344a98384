"""A deterministic random-weight Step-Audio-2-mini checkpoint folder, in the official layout.

    python -m voxbackend.models.step_audio2.tiny --out DIR [--seed N]

writes DIR/config.json (`text_config` and `audio_encoder_config`, as the official file nests them),
DIR/model.safetensors (the LM under `model.` and `lm_head.`, the audio encoder under `encoder.` and `adapter.`),
DIR/tokenizer.json (a toy byte-level BPE plus Step's chat and audio tokens), DIR/token2wav/ (flow.pt, hift.pt and
our token2wav.json with the tiny sizes) and DIR/voices/default.safetensors (the voice replies are spoken in).
The vocabulary keeps the official size and the audio tokens' place (6561 S3 codes from id 151696), so the tiny LM
can say text and audio ids alike.

Weights are at unit scale, so greedy decoding does not meet near-ties that float rounding could flip. The head's
rows of ids the toy vocabulary leaves unused are zero (so they are never picked over the spread of the real ones),
and its text rows are scaled up so that replies mix text and audio ids.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from voxbackend.components.features.mel_features import flow_mel
from voxbackend.components.flow_hift.dit_flow import DiTFlow
from voxbackend.models.checkpoint_cache import build_once, cache_root
from voxbackend.models.cosyvoice2.tiny import voice_clip
from voxbackend.models.cosyvoice2.tiny_codec import tiny_state_dicts as tiny_codec_state_dicts
from voxbackend.models.step_audio2.audio_encoder import AudioEncoder, AudioEncoderConfig
from voxbackend.models.step_audio2.codec import CODEC_FOLDER, CONFIG_NAME, DEFAULT_VOICE, VOICES_FOLDER, CodecConfig
from voxbackend.models.step_audio2.model import AUDIO_CODES, AUDIO_OFFSET
from voxbackend.models.tiny_tokenizer import CORPUS
from voxbackend.models.tiny_weights import perturb_default_inits

VOCAB = 158720
TEXT_VOCAB = 1024  # the toy BPE's ids, then the added tokens below
# the text rows of the head, scaled up: 1024 text ids against 6561 audio ids would leave a reply almost all audio
TEXT_HEAD_SCALE = 1.4
ADDED_TOKENS = ("<|endoftext|>", "<|BOT|>", "<|EOT|>", "<audio_start>", "<audio_end>", "<audio_patch>",
                "<tts_start>", "<tts_end>")
TEXT_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096, max_seq_len=4096, rope_theta=1000000.0,
                   rms_norm_eps=1e-6, vocab_size=VOCAB)
# token2wav's sizes (token2wav.json); HiFT's are CosyVoice2's tiny ones
CODEC_CONFIG = {
    "flow": {"encoder": {"size": 64, "heads": 4, "linear_units": 128, "num_blocks": 2, "num_up_blocks": 2},
             "estimator": {"hidden_size": 64, "depth": 2, "num_heads": 2, "head_dim": 32, "mlp_ratio": 2.0}},
    "hift": {"base_channels": 32, "f0_channels": 32},
}
ENCODER = AudioEncoderConfig(n_mels=128, n_audio_ctx=1500, n_audio_state=32, n_audio_head=4, n_audio_layer=2,
                             llm_dim=TEXT_CONFIG["hidden_size"])


def build_tokenizer():
    """Byte-level BPE trained on the tiny corpus, then Step's added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens(list(ADDED_TOKENS))
    return tok


def lm_state_dict(seed: int, used_ids: int) -> dict[str, torch.Tensor]:
    """A Qwen2ForCausalLM state dict (the official LM's names) at unit scale; head rows of unused ids zero."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in TEXT_CONFIG.items() if k != "max_seq_len"}, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            state[name] = torch.rand(p.shape, generator=g) * 0.5 + 0.75
        elif "embed" in name:
            state[name] = torch.randn(p.shape, generator=g)
        elif p.ndim == 1:  # q/k/v biases
            state[name] = torch.randn(p.shape, generator=g) * 0.1
        else:
            state[name] = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
    head = state["lm_head.weight"]
    head[:TEXT_VOCAB] *= TEXT_HEAD_SCALE
    head[used_ids:AUDIO_OFFSET] = 0.0
    head[AUDIO_OFFSET + AUDIO_CODES:] = 0.0
    return state


def flow_state(seed: int) -> dict[str, torch.Tensor]:
    """The tiny DiT flow's state dict: every matrix N(0, 1/fan_in) (upstream zero-initialises the DiT's adaLN and
    output layers, which would make its vector field zero), norms and biases drawn away from 1 and 0."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        flow = DiTFlow(CodecConfig.from_dict(CODEC_CONFIG).flow)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for t in flow.state_dict().values():
            if t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=generator) / t[0].numel() ** 0.5)
    perturb_default_inits(flow, generator)
    return {k: v.clone() for k, v in flow.state_dict().items()}


def write_codec(out: Path, seed: int) -> None:
    """token2wav/ (flow.pt, hift.pt with upstream's `generator.` prefix, our token2wav.json with the tiny sizes) and
    the default voice: the mel of a synthetic clip with random speech tokens and a random speaker vector."""
    folder = out / CODEC_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(flow_state(seed), folder / "flow.pt")
    _, _, hift_state = tiny_codec_state_dicts(seed + 2)  # CosyVoice2's tiny HiFT: audible, voiced and unvoiced
    torch.save({f"generator.{k}": v for k, v in hift_state.items()}, folder / "hift.pt")
    (folder / CONFIG_NAME).write_text(json.dumps(CODEC_CONFIG, indent=1) + "\n")
    tokens = 20
    mel = flow_mel(torch.from_numpy(voice_clip(2 * tokens * 480 / 24000 + 0.1, 24000, seed)))[: 2 * tokens]
    g = torch.Generator().manual_seed(seed + 3)
    voice = {"speech_tokens": torch.randint(0, AUDIO_CODES, (tokens,), generator=g, dtype=torch.int32),
             "speech_feat": mel.float().contiguous(), "embedding": torch.randn(192, generator=g)}
    (out / VOICES_FOLDER).mkdir(exist_ok=True)
    save_file(voice, str(out / VOICES_FOLDER / f"{DEFAULT_VOICE}.safetensors"))


def write_tiny_step_audio2(out: str | Path, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    weights = lm_state_dict(seed, tok.get_vocab_size())
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        encoder = AudioEncoder(ENCODER)
    perturb_default_inits(encoder, torch.Generator().manual_seed(seed + 2))
    weights.update(encoder.state_dict())
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    config = {"architectures": ["StepAudio2ForCausalLM"], "model_type": "step_audio_2",
              "text_config": TEXT_CONFIG, "audio_encoder_config": {**dataclasses.asdict(ENCODER),
                                                                   "n_codebook_size": 4096}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_codec(out, seed + 10)
    return out


def ensure_default_step_audio2(root: str | Path | None = None) -> tuple[Path, None]:
    """(model_dir, None): the tiny Step-Audio 2, built once into `<VOXBACKEND_CACHE>-step_audio2`."""
    root = cache_root("-step_audio2") if root is None else root
    return build_once(root, lambda out: write_tiny_step_audio2(out / "step_audio2", seed=0)) / "step_audio2", None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_tiny_step_audio2(args.out, args.seed))


if __name__ == "__main__":
    main()
