"""A plain Hugging Face LlamaForCausalLM served as a token-only model: no codec, used for backbone checks."""
from __future__ import annotations

from pathlib import Path

import torch

from voxbackend.models.base import LMGeometry, ModelSpec, SpeechModel
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.llama import LlamaConfig, build_llama


def llama_geometry(cfg: LlamaConfig) -> LMGeometry:
    return LMGeometry(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_context=cfg.max_position_embeddings,
    )


def eos_ids(hf_config: dict) -> tuple[int, ...]:
    eos = hf_config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


class TokenLM(SpeechModel):
    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
        hf = read_config(model_dir)
        self.cfg = LlamaConfig.from_hf(hf)
        self.backbone = build_llama(self.cfg, load_safetensors(model_dir), device, dtype)
        self.spec = ModelSpec(
            name="llama",
            geometry=llama_geometry(self.cfg),
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
