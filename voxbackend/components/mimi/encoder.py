"""Mimi encoder: 24 kHz audio -> Mimi codes [B, num_quantizers, frames] at 12.5 Hz (CSM's context audio).

Loads the same Hugging Face `MimiModel` layout as the decoder (`encoder.layers.*`, `encoder_transformer.*`,
`downsample.*`, `quantizer.*`; also inside a CSM checkpoint under `codec_model.`). One-shot, not streaming:
preprocessing encodes a whole reference clip once.

  audio -> causal SEANet encoder (x4 x5 x6 x8, 960 samples per 25 Hz step) -> sliding-window transformer
        -> stride-2 downsample conv to 12.5 Hz -> split RVQ: the semantic quantizer (first codebook) and the
           acoustic one (the rest) each project the same latents and quantize their own residual chain.

Padding follows the reference encoder exactly, so codes match it bit for bit: every conv is causal (left pad of
effective kernel - stride) and right-padded just enough that a partial last step still yields an output, i.e. a
stride-s conv maps L steps to ceil(L / s). SEANet convs pad with zeros, the downsample replicates its edge values.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.mimi.decoder import MLP, AttentionProjections, LayerScale, rope_inv_freq
from voxbackend.components.mimi.weights import (
    codebook_tables, flat_names, frame_size, read_codec_config, read_codec_tensors,
)


class Conv(nn.Module):
    """Causal conv, any stride: L steps -> ceil(L / stride) outputs."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.stride, self.pad_mode = stride, pad_mode
        self.left = (kernel - 1) * dilation + 1 - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right = -x.shape[-1] % self.stride  # complete the last stride
        return self.conv(F.pad(x, (self.left, right), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int):
        super().__init__()
        self.block = nn.ModuleList([nn.ELU(), Conv(dim, hidden, kernel, dilation=dilation),
                                    nn.ELU(), Conv(hidden, dim, 1)])  # indices as in the checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for m in self.block:
            y = m(y)
        return x + y


class SeanetEncoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        nf, scale = cfg["num_filters"], 1
        layers: list[nn.Module] = [Conv(cfg["audio_channels"], nf, cfg["kernel_size"])]
        for r in reversed(cfg["upsampling_ratios"]):  # the decoder's ratios, mirrored
            c = scale * nf
            layers += [ResnetBlock(c, c // cfg["compress"], cfg["residual_kernel_size"],
                                   cfg["dilation_growth_rate"] ** j) for j in range(cfg["num_residual_layers"])]
            layers += [nn.ELU(), Conv(c, 2 * c, 2 * r, stride=r)]
            scale *= 2
        layers += [nn.ELU(), Conv(scale * nf, cfg["hidden_size"], cfg["last_kernel_size"])]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return x


class Attention(AttentionProjections):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.rotated_qkv(x, cos, sin), mask)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg.get("norm_eps", 1e-5)
        self.input_layernorm = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(cfg)
        self.self_attn_layer_scale = LayerScale(d)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(cfg)
        self.mlp_layer_scale = LayerScale(d)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """Whole-clip sliding-window transformer: step t attends to steps t - window + 1 .. t."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.window = cfg["sliding_window"]
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.register_buffer("inv_freq", rope_inv_freq(cfg, self.layers[0].self_attn.head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        lag = pos[:, None] - pos[None, :]
        mask = ((lag >= 0) & (lag < self.window))[None, None]
        freqs = pos[:, None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class MimiEncoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        assert cfg.get("use_causal_conv", True) and cfg.get("pad_mode", "constant") == "constant"
        assert not cfg.get("use_conv_shortcut", False)
        self.config = cfg
        self.sample_rate: int = cfg["sampling_rate"]
        self.num_codebooks: int = cfg["num_quantizers"]
        self.num_semantic: int = cfg.get("num_semantic_quantizers", 1)
        self.codebook_size: int = cfg["codebook_size"]
        self.frame_size: int = frame_size(cfg)
        self.latent_stride = self.frame_size // math.prod(cfg["upsampling_ratios"])  # transformer steps per frame
        d, dq = cfg["hidden_size"], cfg.get("vector_quantization_hidden_dimension", 256)
        self.encoder = SeanetEncoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        self.downsample = (Conv(d, d, 2 * self.latent_stride, self.latent_stride, bias=False, pad_mode="replicate")
                           if self.latent_stride > 1 else None)
        # 1x1 conv weights [dq, d, 1] (kept as convs: the same kernel as the reference, so the same rounding)
        self.semantic_proj = nn.Parameter(torch.zeros(dq, d, 1)) if dq != d else None
        self.acoustic_proj = nn.Parameter(torch.zeros(dq, d, 1)) if dq != d else None
        self.register_buffer("codebooks", torch.zeros(self.num_codebooks, self.codebook_size, dq))

    # ---- loading ----
    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        prefix: str = "") -> "MimiEncoder":
        """A Mimi folder (config.json + safetensors); `prefix` selects the codec inside a bigger checkpoint
        ("codec_model." in a CSM folder, whose config.json holds the Mimi config under "codec_config")."""
        path = Path(path)
        model = cls(read_codec_config(path))
        model.load_hf_weights(read_codec_tensors(path, prefix))
        books = model.codebooks.clone()
        model = model.to(device=device, dtype=dtype).eval()
        model.codebooks.data = books.to(device)  # nearest-centroid search stays in float32
        return model

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        w = flat_names(weights)
        own: dict[str, torch.Tensor] = {
            "codebooks": torch.stack(codebook_tables(w, self.num_semantic, self.num_codebooks))}
        for part in ("semantic", "acoustic"):
            if getattr(self, f"{part}_proj") is not None:
                own[f"{part}_proj"] = w[f"quantizer.{part}_residual_vector_quantizer.input_proj.weight"]
        own.update({k: v for k, v in w.items() if k.startswith(("encoder.", "encoder_transformer.", "downsample."))})
        self.load_state_dict(own, strict=True)

    # ---- encoding ----
    def num_frames(self, samples: int) -> int:
        return math.ceil(samples / self.frame_size)

    @torch.inference_mode()
    def latents(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, channels, samples] -> unquantized latents [B, hidden, frames]."""
        w = self.encoder.layers[0].conv.weight
        x = self.encoder(audio.to(device=w.device, dtype=w.dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.downsample(x) if self.downsample is not None else x

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor, num_quantizers: int | None = None) -> torch.Tensor:
        """audio [B, channels, samples] at sample_rate -> codes [B, num_quantizers, ceil(samples / frame_size)]."""
        n = self.num_codebooks if num_quantizers is None else num_quantizers
        if audio.dim() != 3 or audio.shape[1] != self.config["audio_channels"] or audio.shape[-1] == 0:
            raise ValueError(f"audio must be [B, {self.config['audio_channels']}, samples > 0], "
                             f"got {list(audio.shape)}")
        if not self.num_semantic <= n <= self.num_codebooks:
            raise ValueError(f"num_quantizers must be in [{self.num_semantic}, {self.num_codebooks}], got {n}")
        z = self.latents(audio)
        B, _, T = z.shape
        codes = []
        for proj, books in ((self.semantic_proj, self.codebooks[:self.num_semantic]),
                            (self.acoustic_proj, self.codebooks[self.num_semantic:n])):
            r = F.conv1d(z, proj) if proj is not None else z
            r = r.transpose(1, 2).reshape(B * T, -1).float()  # [frames, dq], all rows at once
            for book in books:  # residual VQ: each codebook quantizes what the previous ones left
                idx = torch.cdist(r[None], book[None])[0].argmin(-1)
                r = r - book[idx]
                codes.append(idx.view(B, T))
        return torch.stack(codes, dim=1)
