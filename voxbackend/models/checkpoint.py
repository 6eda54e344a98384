"""Reading a local Hugging Face checkpoint folder: config.json and *.safetensors (sharded or not)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: expected a Hugging Face checkpoint folder")
    return json.loads(path.read_text())


def load_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors
