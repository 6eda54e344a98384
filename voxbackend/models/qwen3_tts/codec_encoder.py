"""The encoder half of the Qwen3-TTS 12 Hz speech tokenizer: a 24 kHz reference clip -> codes [frames, 16], the
in-context reference codes of a Base (voice clone) prompt.

It is a Mimi encoder (voxbackend.components.mimi.encoder, loaded from the tokenizer folder's `encoder_config` and
`encoder.*` tensors) keeping the first `encoder_valid_num_quantizers` codebooks (16 of the 32 it has: 1 semantic +
15 acoustic, what the decoder reads). Two facts of the reference that differ from a plain Mimi:
- its transformer attends to every earlier step of the clip, not to a sliding window: the released model was
  built on transformers 4.57.3, whose Mimi encoder ignored `sliding_window` (250 steps, 10 s) there, and the
  reference tokenizer restores that on newer transformers (its `restore_mimi_full_attention`); on a 12 s clip a
  250-step window changes about 4 % of the codes;
- a clip of n samples gives ceil(n / 1920) frames (the last one partial), as the reference trims them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from voxbackend.components.mimi.encoder import MimiEncoder
from voxbackend.components.mimi.weights import read_codec_tensors

TOKENIZER_DIR = "speech_tokenizer"  # inside a Qwen3-TTS checkpoint folder
MAX_POSITIONS = 8000  # MimiConfig's max_position_embeddings when a config leaves it out


class Qwen3TTSEncoder:
    def __init__(self, mimi: MimiEncoder, num_codebooks: int):
        if not mimi.num_semantic <= num_codebooks <= mimi.num_codebooks:
            raise ValueError(f"encoder_valid_num_quantizers must be in [{mimi.num_semantic}, {mimi.num_codebooks}], "
                             f"got {num_codebooks}")
        self.mimi = mimi.eval()
        self.num_codebooks = num_codebooks
        self.sample_rate: int = mimi.sample_rate
        self.frame_size: int = mimi.frame_size  # 1920: 24 kHz at 12.5 Hz
        # positions past the RoPE table the reference was configured for are not meaningful
        positions = mimi.config.get("max_position_embeddings", MAX_POSITIONS)
        self.max_samples = positions * mimi.frame_size // mimi.latent_stride

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "Qwen3TTSEncoder":
        """A speech-tokenizer folder, or a Qwen3-TTS checkpoint folder holding one as speech_tokenizer/."""
        path = Path(path)
        if (path / TOKENIZER_DIR / "config.json").is_file():
            path = path / TOKENIZER_DIR
        cfg = json.loads((path / "config.json").read_text())
        if "encoder_config" not in cfg:
            raise ValueError(f"{path} has no encoder_config: not a Qwen3-TTS 12 Hz speech tokenizer")
        mimi_cfg = dict(cfg["encoder_config"])
        # whole-clip attention (module docstring)
        mimi_cfg["sliding_window"] = mimi_cfg.get("max_position_embeddings", MAX_POSITIONS)
        mimi = MimiEncoder(mimi_cfg)
        mimi.load_hf_weights(read_codec_tensors(path, "encoder."))
        books = mimi.codebooks.clone()
        mimi = mimi.to(device=device, dtype=dtype)
        mimi.codebooks.data = books.to(device)  # nearest-centroid search stays in float32
        return cls(mimi, cfg.get("encoder_valid_num_quantizers", 16))

    def num_frames(self, samples: int) -> int:
        return self.mimi.num_frames(samples)

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """float [samples] at 24 kHz -> int64 codes [ceil(samples / 1920), num_codebooks]."""
        if audio.dim() != 1 or audio.numel() == 0:
            raise ValueError(f"audio must be mono [samples > 0], got {list(audio.shape)}")
        if audio.numel() > self.max_samples:
            raise ValueError(f"audio has {audio.numel()} samples; the encoder takes at most {self.max_samples}")
        return self.mimi.encode(audio[None, None], self.num_codebooks)[0].T.contiguous()
