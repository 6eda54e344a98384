"""Conditional flow matching, speech tokens -> mel (CosyVoice2 `CausalMaskedDiffWithXvec` + `CausalConditionalCFM`).

One call decodes a batch of rows, each its own request's [prompt tokens + tokens so far] with its prompt mel and
speaker embedding: the encoder turns them into `mu` at 50 Hz, and a 10-step Euler solver integrates the estimator
from the fixed noise buffer, with classifier-free guidance (the conditional and unconditional halves of every row
run together as one 2B estimator batch). The noise is a seeded buffer indexed by frame, so decoding is deterministic
and a frame gets the same noise in every window that contains it.

Chatterbox's S3Gen (voxbackend.models.chatterbox.s3gen) runs the same modules with three options: `encode_lookahead`
(its lookahead tokens are encoded, and attended to, like the others and only their frames are dropped),
`chunk_attention=False` (full attention in every window) and the estimator's `meanflow` (Chatterbox-Turbo: a few
plain Euler steps on a linear schedule, no guidance, the estimator told each step's end time).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from voxbackend.components.flow_hift.flow_encoder import EncoderConfig, UpsampleConformerEncoder
from voxbackend.components.flow_hift.flow_estimator import CausalConditionalDecoder, EstimatorConfig
from voxbackend.ints import long_tensor


@dataclass(frozen=True)
class FlowConfig:
    vocab_size: int = 6561
    mel_bins: int = 80
    spk_embed_dim: int = 192
    n_timesteps: int = 10
    cfg_rate: float = 0.7               # inference classifier-free guidance
    noise_seed: int = 0
    max_frames: int = 50 * 300          # the noise buffer: 300 s of mel at 50 Hz, prompt included
    # False (CosyVoice2): a window's lookahead tokens only feed the lookahead conv. True (Chatterbox): they are
    # encoded like the others (other tokens attend to them) and their frames are dropped before the estimator
    encode_lookahead: bool = False
    chunk_attention: bool = True        # False: full attention in streamed windows too (Chatterbox has no chunks)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)

    @property
    def token_mel_ratio(self) -> int:
        return self.encoder.upsample

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len


@dataclass
class FlowRow:
    """One request's flow input for one window."""
    tokens: torch.Tensor        # (N,) long: prompt tokens + speech tokens, the lookahead context last unless finalize
    prompt_feat: torch.Tensor   # (P_mel, mel_bins) prompt mel, aligned with the prompt tokens
    embedding: torch.Tensor     # (spk_embed_dim,) speaker embedding
    finalize: bool              # no lookahead context: the utterance's last window
    streaming: bool             # chunk-causal attention (the reference decodes its final window with full attention)


def solve_euler_cfg(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                    n_timesteps: int, cfg_rate: float) -> torch.Tensor:
    """Euler steps from t=0 to 1 on the cosine schedule 1 - cos(pi/2 s), with classifier-free guidance.
    velocity(x2, t2) runs the estimator on the doubled batch [conditional; unconditional] at times t2 (2B,);
    v = (1 + w) v_cond - w v_uncond. x stays float32. t advances by the step and the next step is measured from it,
    as the references do (not read off the schedule). CosyVoice2's and Step-Audio 2's flows both solve this way."""
    t_span = torch.linspace(0, 1, n_timesteps + 1, device=x.device, dtype=torch.float32)
    t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    t, dt = t_span[0], t_span[1] - t_span[0]
    b = x.size(0)
    for step in range(1, len(t_span)):
        v = velocity(torch.cat([x, x]), t.expand(2 * b)).float()
        x = x + dt * ((1.0 + cfg_rate) * v[:b] - cfg_rate * v[b:])
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return x


class Estimator(nn.Module):
    """Holds the estimator under the reference's `decoder.estimator` name."""

    def __init__(self, cfg: EstimatorConfig):
        super().__init__()
        self.estimator = CausalConditionalDecoder(cfg)


class FlowMatching(nn.Module):
    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        size = cfg.encoder.size
        self.input_embedding = nn.Embedding(cfg.vocab_size, size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(size, cfg.mel_bins)
        self.decoder = Estimator(cfg.estimator)
        generator = torch.Generator().manual_seed(cfg.noise_seed)
        self.register_buffer("noise", torch.randn(1, cfg.mel_bins, cfg.max_frames, generator=generator),
                             persistent=False)

    @torch.inference_mode()
    def forward(self, rows: list[FlowRow]) -> list[torch.Tensor]:
        """Returns each row's mel after its prompt: (mel_bins, token_mel_ratio * tokens - prompt frames)."""
        cfg, device = self.cfg, self.noise.device
        ratio, lookahead = cfg.token_mel_ratio, cfg.pre_lookahead_len
        n_rows = len(rows)
        # the sizes from the host's lists: reading them back from device tensors would wait for the device
        context_n = [0 if r.finalize else lookahead for r in rows]
        total_n = [len(r.tokens) for r in rows]
        frames_n = [(t - c) * ratio for t, c in zip(total_n, context_n)]
        if min(frames_n) <= 0:
            raise ValueError("every flow row needs at least one token besides its lookahead context")
        t_max = max(frames_n)
        if t_max > cfg.max_frames:
            raise ValueError(f"{t_max} mel frames exceed the noise buffer ({cfg.max_frames})")
        context, total = long_tensor(context_n, device), long_tensor(total_n, device)
        lengths, frames = total - context, long_tensor(frames_n, device)
        streaming = torch.tensor([r.streaming and cfg.chunk_attention for r in rows], device=device)
        tokens = torch.zeros(n_rows, max(total_n), dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            tokens[i, :len(r.tokens)] = r.tokens.to(device)
        dtype = self.input_embedding.weight.dtype
        valid = (torch.arange(tokens.size(1), device=device)[None] < total[:, None]).unsqueeze(-1).to(dtype)
        x = self.input_embedding(tokens.clamp(min=0)) * valid
        if cfg.encode_lookahead:
            h = self.encoder(x, total, torch.zeros_like(context), streaming, max(total_n))
        else:
            h = self.encoder(x, lengths, context, streaming, t_max // ratio)
        mu = self.encoder_proj(h[:, :t_max]).transpose(1, 2).contiguous()   # (B, mel, T)
        mask = (torch.arange(t_max, device=device)[None] < frames[:, None]).to(dtype).unsqueeze(1)
        spks = self.spk_embed_affine_layer(
            F.normalize(torch.stack([r.embedding for r in rows]).to(device, dtype), dim=1))
        cond = torch.zeros_like(mu)
        for i, r in enumerate(rows):
            cond[i, :, :r.prompt_feat.size(0)] = r.prompt_feat.to(device, dtype).T
        mel = self._solve(self.noise[:, :, :t_max].expand(n_rows, -1, -1).float() * mask.float(),
                          mu, mask, spks, cond, streaming)
        return [mel[i, :, r.prompt_feat.size(0):frames_n[i]].float() for i, r in enumerate(rows)]

    # The ODE's state x and its time steps stay float32 in a bfloat16 model (only the estimator runs in the model's
    # dtype): ten Euler sums of bfloat16 velocities into a bfloat16 state lose the mel's low bits step by step.
    def _solve(self, x, mu, mask, spks, cond, streaming) -> torch.Tensor:
        """Euler steps on a cosine time schedule; guidance v = (1 + w) v(cond) - w v(uncond). x: float32."""
        cfg = self.cfg
        if cfg.estimator.meanflow:
            return self._solve_meanflow(x, mu, mask, spks, cond, streaming)
        zeros = torch.zeros_like
        mask2, mu2 = torch.cat([mask, mask]), torch.cat([mu, zeros(mu)])
        spks2, cond2, streaming2 = (torch.cat([spks, zeros(spks)]), torch.cat([cond, zeros(cond)]),
                                    torch.cat([streaming, streaming]))

        def velocity(x2: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
            return self.decoder.estimator(x2.to(mu.dtype), mask2, mu2, t2, spks2, cond2, streaming2)

        return solve_euler_cfg(velocity, x, cfg.n_timesteps, cfg.cfg_rate)

    def _solve_meanflow(self, x, mu, mask, spks, cond, streaming) -> torch.Tensor:
        """Euler steps on a linear schedule, each told its end time; no guidance (the mean-flow model was
        distilled from guided outputs)."""
        t_span = torch.linspace(0, 1, self.cfg.n_timesteps + 1, device=x.device, dtype=torch.float32)
        b = x.size(0)
        for t, r in zip(t_span[:-1], t_span[1:]):
            v = self.decoder.estimator(x.to(mu.dtype), mask, mu, t.expand(b), spks, cond, streaming,
                                       r=r.expand(b)).float()
            x = x + (r - t) * v
        return x
