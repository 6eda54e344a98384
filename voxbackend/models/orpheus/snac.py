"""SNAC decoder (quantizer lookup + convolutional decoder), written for serving.

Same architecture and state-dict names as the `snac` package (v1.2.1), which we use only as a test oracle.
Differences that matter for serving:
  * weight norm is folded into plain conv weights at load time (no per-call reparametrisation);
  * each codebook's out_proj is folded into a (codebook_size, latent_dim) lookup table;
  * the decoder's noise is drawn per batch row from that row's own seeded generator, so a row decodes to the
    same audio whatever batch it is in (and equals snac.SNAC at batch 1 after torch.manual_seed(seed)).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.cuda_graphs import GraphReplayer, bucket_for, pad_rows


class Snake1d(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x + 1/(alpha+1e-9) * sin(alpha*x)^2, same ops as snac's jit snake (bit-equal), but in place on one
        # buffer: the activations are large and these elementwise passes, not the convs, dominated at batch 16
        y = torch.mul(x, self.alpha).sin_()
        return y.mul_(y).mul_((self.alpha + 1e-9).reciprocal()).add_(x)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int, kernel: int = 7):
        super().__init__()
        pad = ((kernel - 1) * dilation) // 2
        self.block = nn.Sequential(
            Snake1d(dim),
            nn.Conv1d(dim, dim, kernel, dilation=dilation, padding=pad, groups=groups),
            Snake1d(dim),
            nn.Conv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).add_(x)  # padding keeps the length, so no crop is needed


class NoiseBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mul_(noise).add_(x)


class DecoderBlock(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, stride: int, noise: bool, groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            Snake1d(input_dim),
            nn.ConvTranspose1d(input_dim, output_dim, 2 * stride, stride=stride,
                               padding=math.ceil(stride / 2), output_padding=stride % 2),
        ]
        if noise:
            layers.append(NoiseBlock(output_dim))
        layers += [ResidualUnit(output_dim, d, groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)  # indices mirror snac's names

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, noise) if isinstance(layer, NoiseBlock) else layer(x)
        return x


class Decoder(nn.Module):
    def __init__(self, input_channel: int, channels: int, rates: list[int], noise: bool, depthwise: bool):
        super().__init__()
        if depthwise:
            layers: list[nn.Module] = [nn.Conv1d(input_channel, input_channel, 7, padding=3, groups=input_channel),
                                       nn.Conv1d(input_channel, channels, 1)]
        else:
            layers = [nn.Conv1d(input_channel, channels, 7, padding=3)]
        output_dim = channels
        for i, stride in enumerate(rates):
            input_dim, output_dim = channels // 2**i, channels // 2 ** (i + 1)
            layers.append(DecoderBlock(input_dim, output_dim, stride, noise, output_dim if depthwise else 1))
        layers += [Snake1d(output_dim), nn.Conv1d(output_dim, 1, 7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, noises: list[torch.Tensor | None]) -> torch.Tensor:
        it = iter(noises)
        for layer in self.model:
            x = layer(x, next(it)) if isinstance(layer, DecoderBlock) else layer(x)
        return x


class SnacDecoder(nn.Module):
    def __init__(self, sampling_rate: int = 24000, encoder_dim: int = 48, encoder_rates: list[int] = (2, 4, 8, 8),
                 latent_dim: int | None = None, decoder_dim: int = 1024, decoder_rates: list[int] = (8, 8, 4, 2),
                 attn_window_size: int | None = None, codebook_size: int = 4096, codebook_dim: int = 8,
                 vq_strides: list[int] = (4, 2, 1), noise: bool = True, depthwise: bool = True, **_: object):
        super().__init__()
        if attn_window_size is not None:
            # the 24 kHz model has no local attention; 32/44 kHz SNAC would need LocalMHA here
            raise NotImplementedError("SnacDecoder supports attn_window_size=None (snac_24khz) only")
        self.sample_rate = sampling_rate
        self.hop_length = math.prod(encoder_rates)
        self.latent_dim = latent_dim or encoder_dim * 2 ** len(encoder_rates)
        self.vq_strides = list(vq_strides)
        self.decoder_rates = list(decoder_rates)
        self.codebook_size = codebook_size
        self.noise = noise
        # codebook i -> out_proj(codebook i), filled at load: (n_codebooks, codebook_size, latent_dim)
        self.register_buffer("tables", torch.zeros(len(vq_strides), codebook_size, self.latent_dim))
        self.decoder = Decoder(self.latent_dim, decoder_dim, self.decoder_rates, noise, depthwise)
        assert math.prod(self.decoder_rates) == self.hop_length
        self.sizes: list[int] | None = None  # batch-size buckets (use_buckets); None: every batch as it comes
        self.replayer: GraphReplayer | None = None
        self._static: dict[tuple, tuple] = {}  # (bucket, code lengths) -> the codes and noises a graph reads

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "SnacDecoder":
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        model = cls(**config)
        if (path / "model.safetensors").exists():
            from safetensors.torch import load_file
            sd = load_file(str(path / "model.safetensors"))
        else:
            sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        model.load_snac_state_dict(sd, config.get("codebook_dim", 8))
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def load_snac_state_dict(self, sd: dict[str, torch.Tensor], codebook_dim: int) -> None:
        sd = _fold_weight_norm(sd)
        tables = []
        for i in range(len(self.vq_strides)):
            p = f"quantizer.quantizers.{i}."
            cb = sd[p + "codebook.weight"].float()                      # (N, D)
            w, b = sd[p + "out_proj.weight"].float(), sd[p + "out_proj.bias"].float()  # (L, D, 1), (L,)
            assert cb.shape[1] == codebook_dim
            tables.append(cb @ w[:, :, 0].T + b)                         # the 1x1 conv applied to every code
        own = {"tables": torch.stack(tables)}
        own.update({k: v for k, v in sd.items() if k.startswith("decoder.")})  # encoder + in_proj ignored
        self.load_state_dict(own, strict=True)

    def _noise_lengths(self, t_latent: int) -> list[int]:
        lengths, t = [], t_latent
        for r in self.decoder_rates:
            t *= r
            lengths.append(t)
        return lengths

    def _draw_noise(self, batch: int, t_latent: int, noise_seeds: list[int]) -> list[torch.Tensor | None]:
        lengths = self._noise_lengths(t_latent)
        if not self.noise:
            return [None] * len(lengths)
        assert len(noise_seeds) == batch, "one noise seed per batch row"
        rows: list[list[torch.Tensor]] = []
        for seed in noise_seeds:
            # CPU generator: same algorithm and draw order as snac at batch 1 after torch.manual_seed(seed)
            g = torch.Generator().manual_seed(int(seed))
            rows.append([torch.randn((1, 1, n), generator=g) for n in lengths])
        p = self.tables
        return [torch.cat([r[k] for r in rows]).to(device=p.device, dtype=p.dtype, non_blocking=True)
                for k in range(len(lengths))]

    def latents(self, codes: list[torch.Tensor]) -> torch.Tensor:
        z = None
        for i, (c, s) in enumerate(zip(codes, self.vq_strides)):
            zi = F.embedding(c.to(self.tables.device), self.tables[i]).transpose(1, 2)  # (B, L, T_i)
            if s > 1:
                zi = zi.repeat_interleave(s, dim=-1)
            z = zi if z is None else z + zi
        return z

    def use_buckets(self, sizes: list[int], capture: bool) -> None:
        """Pad each call to a batch-size bucket and decode from fixed buffers (engine/decode_graphs.py): a CUDA
        graph per (bucket, window length) when capturing (Orpheus' windows are all 4 frames), else eagerly."""
        self.sizes, self._static = sizes, {}
        self.replayer = GraphReplayer("the SNAC decoder", self.tables.device) if capture else None

    @torch.inference_mode()
    def decode(self, codes: list[torch.Tensor], noise_seeds: list[int]) -> torch.Tensor:
        """codes: per codebook [B, T*stride_0/stride_i] (for [4,2,1]: [B,T], [B,2T], [B,4T]) -> audio [B, 1, 4T*hop]."""
        assert len(codes) == len(self.vq_strides)
        if self.sizes is not None and len(noise_seeds) <= self.sizes[-1]:
            return self._decode_bucketed(codes, noise_seeds)
        z = self.latents(codes)
        return self.decoder(z, self._draw_noise(z.shape[0], z.shape[-1], noise_seeds))

    def _decode_bucketed(self, codes: list[torch.Tensor], noise_seeds: list[int]) -> torch.Tensor:
        n = len(noise_seeds)
        b = bucket_for(self.sizes, n)
        # dummy rows repeat the first row's codes and seed; their audio is dropped
        padded = [pad_rows(c, b) for c in codes]
        seeds = list(noise_seeds) + [noise_seeds[0]] * (b - n)
        noises = self._draw_noise(b, padded[0].shape[1] * self.vq_strides[0], seeds)
        key = (b, *(c.shape[1] for c in codes))
        if key not in self._static:  # the buffers a graph reads: this call's inputs, cloned once
            self._static[key] = ([c.clone() for c in padded], [x if x is None else x.clone() for x in noises])
        else:
            for dst, src in zip(self._static[key][0] + self._static[key][1], padded + noises):
                if dst is not None:
                    dst.copy_(src)
        static_codes, static_noises = self._static[key]

        def run() -> torch.Tensor:
            return self.decoder(self.latents(static_codes), static_noises)

        return (run() if self.replayer is None else self.replayer.run(key, run))[:n]


def _fold_weight_norm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """weight_g/weight_v (old torch names) or parametrizations.weight.original0/1 -> plain weight."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        for g_name, v_name in ((".weight_g", ".weight_v"),
                               (".parametrizations.weight.original0", ".parametrizations.weight.original1")):
            if k.endswith(g_name):
                pairs.setdefault(k[: -len(g_name)], {})["g"] = v
                break
            if k.endswith(v_name):
                pairs.setdefault(k[: -len(v_name)], {})["v"] = v
                break
        else:
            out[k] = v
    for base, gv in pairs.items():
        # dim=0 is torch's weight_norm default for Conv1d and ConvTranspose1d alike (what snac uses)
        out[base + ".weight"] = torch._weight_norm(gv["v"].float(), gv["g"].float(), 0)
    return out
