"""HiFT vocoder (CosyVoice2 `HiFTGenerator`): mel -> f0 -> neural source-filter excitation -> ISTFTNet -> 24 kHz.

Batched over rows of equal mel length (its convs are not causal, so rows of different lengths cannot share a padded
batch exactly; the streaming wrapper groups them). The excitation's random initial phases and noise come from each
row's own generator, drawn in the reference's order, so a request's audio does not depend on its batch mates.
`cache_source` overwrites the start of a row's excitation with the tail of its previous window's, which keeps the
sine phase continuous across windows. Weight-normed convs are folded into plain weights when loading.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class HiFTConfig:
    mel_bins: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_channels: int = 512
    # where the excitation's phase is integrated: "frame" (CosyVoice2's SineGen2: at the frame rate, then
    # interpolated; initial phases in [0, 1) turns) or "sample" (CosyVoice 1's SineGen, which Chatterbox keeps: a
    # cumulative sum over every sample; initial phases uniform in [-pi, pi) radians)
    phase_rate: str = "frame"

    @property
    def samples_per_frame(self) -> int:
        return int(np.prod(self.upsample_rates)) * self.hop_len


# parameter names (without the .weight suffix) that the reference wraps in weight_norm
def weight_norm_names(cfg: HiFTConfig) -> list[str]:
    names = ["conv_pre", "conv_post"] + [f"ups.{i}" for i in range(len(cfg.upsample_rates))]
    names += [f"f0_predictor.condnet.{2 * i}" for i in range(5)]
    blocks = [(f"resblocks.{i}", d) for i, d in enumerate(list(cfg.resblock_dilation_sizes) * len(cfg.upsample_rates))]
    blocks += [(f"source_resblocks.{i}", d) for i, d in enumerate(cfg.source_resblock_dilation_sizes)]
    for prefix, dilations in blocks:
        for j in range(len(dilations)):
            names += [f"{prefix}.convs1.{j}", f"{prefix}.convs2.{j}"]
    return names


def fold_weight_norm(state: dict[str, torch.Tensor], cfg: HiFTConfig) -> dict[str, torch.Tensor]:
    """Official checkpoints store weight-normed convs as (g, v) pairs, under either the old (`weight_g`/`weight_v`)
    or the parametrization (`parametrizations.weight.original0/1`) names; return plain `weight`s."""
    state = {k.removeprefix("generator."): v for k, v in state.items()}
    for name in weight_norm_names(cfg):
        for g_key, v_key in ((f"{name}.weight_g", f"{name}.weight_v"),
                             (f"{name}.parametrizations.weight.original0",
                              f"{name}.parametrizations.weight.original1")):
            if g_key in state:
                g, v = state.pop(g_key), state.pop(v_key)
                state[f"{name}.weight"] = torch._weight_norm(v, g, 0)
    return state


def weight_norm_pairs(state: dict[str, torch.Tensor], cfg: HiFTConfig) -> dict[str, torch.Tensor]:
    """A plain state dict with its weight-normed convs as official checkpoints store them (the parametrization's
    g = |w| per output channel, v = w): what tiny checkpoint writers save, fold_weight_norm's inverse."""
    out = dict(state)
    for name in weight_norm_names(cfg):
        w = out.pop(f"{name}.weight")
        out[f"{name}.parametrizations.weight.original0"] = w.flatten(1).norm(dim=1).view(-1, *[1] * (w.ndim - 1))
        out[f"{name}.parametrizations.weight.original1"] = w.clone()
    return out


def conv_padding(kernel: int, dilation: int) -> int:
    return (kernel * dilation - dilation) // 2


class Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d, padding=conv_padding(kernel, d))
                                    for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=conv_padding(kernel, 1))
                                    for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(a2(c1(a1(x))))
        return x


class F0Predictor(nn.Module):
    def __init__(self, mel_bins: int, channels: int):
        super().__init__()
        convs = []
        for i in range(5):
            convs += [nn.Conv1d(mel_bins if i == 0 else channels, channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*convs)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class SourceModule(nn.Module):
    """Harmonic sines at f0 x 1..(nb_harmonics + 1), noise where unvoiced, merged to one excitation channel."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        if cfg.phase_rate not in ("frame", "sample"):
            raise ValueError(f"phase_rate must be 'frame' or 'sample', not {cfg.phase_rate!r}")
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """f0: (B, L, 1) at the audio rate. Returns the excitation (B, L, 1)."""
        cfg = self.cfg
        if cfg.phase_rate == "sample":
            return self._per_sample(f0, generators)
        scale = cfg.samples_per_frame
        b, length, _ = f0.shape
        dim = cfg.nb_harmonics + 1
        # per row, in the reference's draw order: initial phases, sine noise, then the (unused) noise branch. The
        # reference's sine noise is randn_like of a (B, dim, L) tensor viewed as (B, L, dim): torch fills such a
        # non-contiguous tensor element by element, not with its vectorized kernel, so draw into the same layout
        draws = [(torch.rand(1, dim, generator=g), torch.empty(1, dim, length).transpose(1, 2).normal_(generator=g),
                  torch.randn(1, length, 1, generator=g)) for g in generators]
        rand_ini = torch.cat([d[0] for d in draws]).to(f0.device, f0.dtype)
        noise = torch.cat([d[1] for d in draws]).to(f0.device, f0.dtype)
        harmonics = f0 * torch.arange(1, dim + 1, device=f0.device, dtype=f0.dtype)
        rad = (harmonics / cfg.sampling_rate) % 1
        rand_ini[:, 0] = 0
        rad[:, 0, :] = rad[:, 0, :] + rand_ini
        # integrate the phase at the frame rate, then interpolate back up (as the reference does: cheap and smooth)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * np.pi
        phase = F.interpolate(phase.transpose(1, 2) * scale, scale_factor=scale, mode="linear").transpose(1, 2)
        sines = torch.sin(phase) * cfg.nsf_alpha
        uv = (f0 > cfg.nsf_voiced_threshold).to(f0.dtype)
        noise = (uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3) * noise
        return torch.tanh(self.l_linear((sines * uv + noise).to(self.l_linear.weight.dtype)))

    def _per_sample(self, f0: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        cfg = self.cfg
        length, dim = f0.size(1), cfg.nb_harmonics + 1
        # per row, in the reference's draw order: initial phases, sine noise (B, dim, L), the (unused) noise branch
        draws = [(torch.rand(1, dim, 1, generator=g), torch.randn(1, dim, length, generator=g),
                  torch.randn(1, length, 1, generator=g)) for g in generators]
        low, high = torch.tensor(-np.pi), torch.tensor(np.pi)
        phase0 = (low + torch.cat([d[0] for d in draws]) * (high - low)).to(f0.device)
        phase0[:, 0] = 0
        noise = torch.cat([d[1] for d in draws]).to(f0.device)
        f0 = f0.transpose(1, 2).float()                                        # (B, 1, L)
        harmonics = f0 * torch.arange(1, dim + 1, device=f0.device, dtype=f0.dtype)[:, None] / cfg.sampling_rate
        # the phase as a float32 running sum over the whole window, wrapped after summing, as the reference does
        theta = 2 * np.pi * (torch.cumsum(harmonics, dim=-1) % 1)
        sines = cfg.nsf_alpha * torch.sin(theta + phase0)
        uv = (f0 > cfg.nsf_voiced_threshold).float()
        noise = (uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3) * noise
        excitation = (sines * uv + noise).transpose(1, 2).to(self.l_linear.weight.dtype)
        return torch.tanh(self.l_linear(excitation))


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.cfg = cfg
        base, n_up = cfg.base_channels, len(cfg.upsample_rates)
        self.m_source = SourceModule(cfg)
        self.conv_pre = nn.Conv1d(cfg.mel_bins, base, 7, 1, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        down_rates = np.cumprod([1] + list(cfg.upsample_rates[::-1][:-1]))[::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(down_rates, cfg.source_resblock_kernel_sizes,
                                          cfg.source_resblock_dilation_sizes)):
            ch, u = base // 2 ** (i + 1), int(u)
            self.source_downs.append(nn.Conv1d(cfg.n_fft + 2, ch, 1, 1) if u == 1 else
                                     nn.Conv1d(cfg.n_fft + 2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, tuple(d)))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, tuple(d))
            for i in range(n_up) for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = nn.Conv1d(base // 2 ** n_up, cfg.n_fft + 2, 7, 1, padding=3)
        self.f0_predictor = F0Predictor(cfg.mel_bins, cfg.f0_channels)
        # the STFT and iSTFT stay float32 in a bfloat16 model: neither MKL's FFT nor cuFFT takes bfloat16, and a
        # bfloat16 window or magnitude (exp of the conv output) would cost the audio ~8 bits. Kept out of the
        # module's buffers so that .to(dtype) leaves it float32.
        self.stft_window = torch.hann_window(cfg.n_fft, periodic=True)

    def _apply(self, fn, recurse=True):
        """Moves reach every part; dtype casts (.to(dtype), .bfloat16()) all but the F0 predictor and conv_post,
        which stay float32 with their weights never rounded. The source's phase is a running sum of the F0 over
        the window, so an F0 0.1% off puts the harmonics out of phase within a second; conv_post's phase half goes
        through sin() of values up to ~100, where bfloat16's step is 0.5."""
        float32 = (self.f0_predictor, self.conv_post)

        def move_only(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        if recurse:
            for child in self.children():
                child._apply(move_only if any(child is m for m in float32) else fn)
        return super()._apply(fn, recurse=False)

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, generators: list[torch.Generator],
                cache_source: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """mel: (B, mel_bins, T), float32 (the F0 comes from it). Returns speech (B, T * samples_per_frame) and the
        excitation (B, 1, same), float32."""
        f0 = self.f0_predictor(mel.float())
        f0 = f0.repeat_interleave(self.cfg.samples_per_frame, dim=1).unsqueeze(-1)
        source = self.m_source(f0, generators).transpose(1, 2)
        for i, cached in enumerate(cache_source):
            if cached is not None and cached.size(-1):
                source[i, :, :cached.size(-1)] = cached.to(source)
        return self._decode(mel.to(self.conv_pre.weight.dtype), source), source

    def _decode(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        window = self.stft_window.to(x.device)
        spec = torch.view_as_real(torch.stft(source.squeeze(1).float(), cfg.n_fft, cfg.hop_len, cfg.n_fft,
                                             window=window, return_complex=True))
        s_stft = torch.cat([spec[..., 0], spec[..., 1]], dim=1).to(x.dtype)
        x = self.conv_pre(x)
        n_kernels = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            x = sum(self.resblocks[i * n_kernels + j](x) for j in range(n_kernels)) / n_kernels
        x = self.conv_post(F.leaky_relu(x).float())
        half = cfg.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clip(max=1e2)
        phase = torch.sin(x[:, half:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        audio = torch.istft(spec, cfg.n_fft, cfg.hop_len, cfg.n_fft, window=window)
        return audio.clamp(-cfg.audio_limit, cfg.audio_limit)
