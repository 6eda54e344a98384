"""Reading Mimi weights (a Mimi folder, or the codec inside a CSM checkpoint), shared by decoder and encoder."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch


def read_codec_config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("codec_config") or cfg  # a CSM config.json holds the Mimi config under "codec_config"


def frame_size(cfg: dict) -> int:
    """Audio samples per code frame (1920 for kyutai/mimi: 24 kHz at 12.5 Hz), from the Mimi config alone."""
    hop = math.prod(cfg["upsampling_ratios"])
    frame_rate = cfg.get("frame_rate") or cfg.get("_frame_rate") or cfg["sampling_rate"] / (2 * hop)
    return hop * round(math.ceil(cfg["sampling_rate"] / hop) / frame_rate)  # hop x transformer steps per frame


def read_codec_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Only the tensors under `prefix` (e.g. "codec_model." in a CSM folder), with the prefix removed."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            weights.update({k[len(prefix):]: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
    return weights


def codebook_tables(w: dict[str, torch.Tensor], num_semantic: int, num_codebooks: int) -> list[torch.Tensor]:
    """Each codebook's centroids (embed_sum / cluster_usage), semantic codebooks first."""
    books = []
    for part, n in (("semantic", num_semantic), ("acoustic", num_codebooks - num_semantic)):
        for i in range(n):
            cb = f"quantizer.{part}_residual_vector_quantizer.layers.{i}.codebook."
            books.append(w[cb + "embed_sum"].float() / w[cb + "cluster_usage"].float().clamp(min=1e-5)[:, None])
    return books


# Newer transformers save MimiModel's encoder and decoder halves nested; map back to the flat kyutai/mimi names.
_RENAMES = [
    (re.compile(r"^encoder\.encoder(_seanet)?\.layers\."), "encoder.layers."),
    (re.compile(r"^encoder\.encoder_transformer\."), "encoder_transformer."),
    (re.compile(r"^encoder\.downsample\."), "downsample."),
    (re.compile(r"^decoder\.decoder(_seanet)?\.layers\."), "decoder.layers."),
    (re.compile(r"^decoder\.decoder_transformer\."), "decoder_transformer."),
    (re.compile(r"^decoder\.upsample\."), "upsample."),
]


def flat_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under the flat kyutai/mimi names, whichever layout they were saved in."""
    out = {}
    for name, tensor in weights.items():
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        out[name] = tensor
    return out
