"""Choose the model class from a checkpoint's config.json."""
from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

from voxbackend.models.base import SpeechModel
from voxbackend.models.checkpoint import read_config

if TYPE_CHECKING:
    import torch

CODEC_FOLDERS = ("snac_24khz", "snac")  # where a codec is looked for when none is given


def find_codec_dir(model_dir: Path) -> Path | None:
    for base in (model_dir, model_dir.parent):
        for name in CODEC_FOLDERS:
            if (base / name / "config.json").is_file():
                return base / name
    return None


def load_frontend(model_dir: str | Path, codec_dir: str | Path | None = None) -> SpeechModel:
    """What preprocessing needs (prepare, default_sampling, voices, spec): without LM weights where the model
    allows, so several CPU preprocess instances never hold copies of a 1B-3B model."""
    model_dir = Path(model_dir)
    from voxbackend.models.csm import CsmFrontend, is_csm_config
    from voxbackend.models.orpheus import OrpheusFrontend, is_orpheus_config

    hf = read_config(model_dir)
    if is_csm_config(hf):
        return CsmFrontend(model_dir, codec_dir)  # loads only the Mimi encoder, and only for context audio
    if is_orpheus_config(hf):
        return OrpheusFrontend(model_dir, _orpheus_codec(model_dir, codec_dir))
    import torch

    return load_model(model_dir, codec_dir, "cpu", torch.float32)


def _orpheus_codec(model_dir: Path, codec_dir: str | Path | None) -> Path:
    codec = Path(codec_dir) if codec_dir else find_codec_dir(model_dir)
    if codec is None:
        raise FileNotFoundError(
            f"Orpheus needs the SNAC 24 kHz codec folder (hubertsiuzdak/snac_24khz); pass codec_dir or put it "
            f"at {model_dir / 'snac_24khz'}"
        )
    return codec


def load_model(
    model_dir: str | Path, codec_dir: str | Path | None, device: str, dtype: "torch.dtype", kind: str | None = None
) -> SpeechModel:
    model_dir = Path(model_dir)
    hf = read_config(model_dir)
    if kind is None:
        from voxbackend.models.csm import is_csm_config
        from voxbackend.models.orpheus import is_orpheus_config

        kind = "csm" if is_csm_config(hf) else "orpheus" if is_orpheus_config(hf) else "llama"
    if kind == "csm":
        from voxbackend.models.csm import Csm

        return Csm(model_dir, codec_dir, device, dtype)  # no codec_dir: the Mimi weights inside the checkpoint
    if kind == "orpheus":
        from voxbackend.models.orpheus import Orpheus

        return Orpheus(model_dir, _orpheus_codec(model_dir, codec_dir), device, dtype)
    if kind == "llama":
        if "LlamaForCausalLM" not in hf.get("architectures", ["LlamaForCausalLM"]):
            raise ValueError(f"unsupported architecture {hf.get('architectures')} in {model_dir}")
        from voxbackend.models.token_lm import TokenLM

        return TokenLM(model_dir, device, dtype)
    raise ValueError(f"unknown model kind {kind!r} (known: csm, orpheus, llama)")
