"""A plain Hugging Face Llama / Qwen2 / Qwen3 / GLM-4 *ForCausalLM or GPT-2 served as a token-only model: no codec,
used for backbone checks."""
from __future__ import annotations

from pathlib import Path

import torch

from voxbackend.models.base import ModelSpec, SpeechModel
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.decoder import DecoderConfig, build_decoder, decoder_family, eos_ids


def is_token_lm_config(hf_config: dict) -> bool:
    return decoder_family(hf_config) is not None


class TokenLM(SpeechModel):
    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        hf = read_config(model_dir)
        family = decoder_family(hf)
        if family is None:
            raise ValueError(f"unsupported architecture {hf.get('architectures')} (model_type "
                             f"{hf.get('model_type')!r}) in {model_dir}: expected a Llama, Qwen, GLM-4 or GPT-2 "
                             "causal LM")
        self.cfg = DecoderConfig.from_hf(hf, family)
        self.backbone = build_decoder(self.cfg, load_safetensors(model_dir), device, dtype)
        self.spec = ModelSpec(
            name=family,
            geometry=self.cfg.geometry(),
            sample_rate=0,
            codes_per_frame=1,
            window=None,
            stop_ids=eos_ids(hf),
            max_tokens=self.cfg.max_position_embeddings,  # a plain LM may generate up to its context
        )

    def forward(self, input_ids, positions, attention):
        return self.backbone(input_ids, positions, attention)

    def logits(self, hidden):
        return self.backbone.logits(hidden)
