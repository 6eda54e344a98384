"""CosyVoice 1's flow, speech tokens -> mel (`MaskedDiffWithXvec.inference` + `ConditionalCFM`), as GLM-4-Voice's
decoder runs it (THUDM/GLM-4-Voice cosyvoice/flow/flow.py), batched over requests.

Per row: [prompt tokens + tokens] are embedded and encoded (conformer_encoder.py, block-causal), projected to 80
channels and stretched to `mel_frames(all tokens)` frames (length_regulator.py: the prompt and the new tokens in
one interpolation, so the prompt mel's end need not fall on a token boundary). The prompt mel conditions the
frames it covers through `cond`, the x-vector (L2-normalized, projected) through `spks`; a 10-step Euler solver on
a cosine schedule integrates the U-Net (unet_estimator.py) from Gaussian noise with classifier-free guidance, and
the frames after the prompt mel are returned.

The noise is each row's own: drawn on the host from its generator, (1, 80, frames), as upstream's
`torch.randn_like(mu)` draws it from torch's generator (which GLM-4-Voice reseeds with 42 at every call), so a
row's mel does not depend on its batch mates and a caller can hand an oracle the same draw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from voxbackend.components.flow_hift.conformer_encoder import ConformerConfig, ConformerEncoder
from voxbackend.components.flow_hift.flow_matching import solve_euler_cfg
from voxbackend.components.flow_hift.length_regulator import InterpolateRegulator, mel_frames
from voxbackend.components.flow_hift.unet_estimator import ConditionalDecoder, UNetConfig
from voxbackend.ints import long_tensor


@dataclass(frozen=True)
class XvecFlowConfig:
    """GLM-4-Voice decoder's config.yaml values by default."""
    vocab_size: int = 16384
    mel_bins: int = 80
    spk_embed_dim: int = 192
    token_rate: float = 12.5            # input_frame_rate
    sample_rate: int = 22050            # the mel frame count's rate and hop are hard-coded upstream
    hop: int = 256
    regulator_stages: int = 4           # len(sampling_ratios)
    n_timesteps: int = 10
    cfg_rate: float = 0.7               # inference classifier-free guidance
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    decoder: UNetConfig = field(default_factory=UNetConfig)

    def frames(self, token_counts: list[int]) -> list[int]:
        return mel_frames(token_counts, self.token_rate, self.sample_rate, self.hop)


@dataclass
class XvecFlowRow:
    """One request's flow input."""
    tokens: torch.Tensor            # (N,) long: prompt tokens, then the tokens to decode
    prompt_feat: torch.Tensor       # (P, mel_bins) prompt mel: the first P frames of the output timeline
    embedding: torch.Tensor         # (spk_embed_dim,) x-vector
    generator: torch.Generator      # a CPU generator: draws the initial noise


class Decoder(nn.Module):
    """Holds the estimator under the reference's `decoder.estimator` name."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.estimator = ConditionalDecoder(cfg)


class XvecFlow(nn.Module):
    def __init__(self, cfg: XvecFlowConfig):
        super().__init__()
        self.cfg = cfg
        size = cfg.encoder.size
        self.input_embedding = nn.Embedding(cfg.vocab_size, size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
        self.encoder = ConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(size, cfg.mel_bins)
        self.length_regulator = InterpolateRegulator(cfg.mel_bins, cfg.regulator_stages)
        self.decoder = Decoder(cfg.decoder)

    @torch.inference_mode()
    def forward(self, rows: list[XvecFlowRow]) -> list[torch.Tensor]:
        """Returns each row's mel after its prompt mel: (mel_bins, frames(N) - P), on the model's device."""
        cfg = self.cfg
        device, dtype = self.input_embedding.weight.device, self.input_embedding.weight.dtype
        # the sizes from the host's lists: reading them back from device tensors would wait for the device
        tokens_n = [len(r.tokens) for r in rows]
        frames_n = cfg.frames(tokens_n)
        prompt_n = [r.prompt_feat.size(0) for r in rows]
        if any(p >= f for p, f in zip(prompt_n, frames_n)):
            raise ValueError("every flow row needs frames after its prompt mel")
        t_max, f_max = max(tokens_n), max(frames_n)
        lengths, frames = long_tensor(tokens_n, device), long_tensor(frames_n, device)
        tokens = torch.zeros(len(rows), t_max, dtype=torch.long)
        cond = torch.zeros(len(rows), cfg.mel_bins, f_max)
        noise = torch.zeros(len(rows), cfg.mel_bins, f_max)
        for i, r in enumerate(rows):
            tokens[i, :tokens_n[i]] = r.tokens
            cond[i, :, :prompt_n[i]] = r.prompt_feat.T
            noise[i, :, :frames_n[i]] = torch.randn(1, cfg.mel_bins, frames_n[i], generator=r.generator)[0]
        tokens, cond, noise = tokens.to(device), cond.to(device, dtype), noise.to(device)
        valid = (torch.arange(t_max, device=device)[None] < lengths[:, None]).unsqueeze(-1).to(dtype)
        h = self.encoder(self.input_embedding(tokens.clamp(min=0)) * valid, lengths)
        mu = self.length_regulator(self.encoder_proj(h), lengths, frames, f_max)       # (B, mel, F)
        mask = (torch.arange(f_max, device=device)[None] < frames[:, None]).to(dtype).unsqueeze(1)
        spks = self.spk_embed_affine_layer(
            F.normalize(torch.stack([r.embedding for r in rows]).to(device, dtype), dim=1))
        mel = self._solve(noise, mu, mask, spks, cond)
        return [mel[i, :, prompt_n[i]:frames_n[i]] for i in range(len(rows))]

    # x and the time steps stay float32 (only the estimator runs in the model's dtype), as in flow_matching.py
    def _solve(self, x, mu, mask, spks, cond) -> torch.Tensor:
        zeros = torch.zeros_like
        mask2, mu2 = torch.cat([mask, mask]), torch.cat([mu, zeros(mu)])
        spks2, cond2 = torch.cat([spks, zeros(spks)]), torch.cat([cond, zeros(cond)])

        def velocity(x2: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
            return self.decoder.estimator(x2.to(mu.dtype), mask2, mu2, t2, spks2, cond2)

        return solve_euler_cfg(velocity, x, self.cfg.n_timesteps, self.cfg.cfg_rate)
