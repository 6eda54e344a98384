"""Step-Audio 2's flow, speech tokens -> mel (its token2wav `CausalMaskedDiffWithXvec` + `CausalConditionalCFM`
with a DiT vector field), for a whole utterance.

[prompt tokens + tokens] are embedded and encoded to `mu` at 50 Hz; a 10-step Euler solver on a cosine time
schedule integrates the DiT from the caller's noise, with classifier-free guidance (the conditional and
unconditional halves run as one batch of two). The prompt mel conditions its own frames through `cond`, and the
mel after the prompt is returned.

`DiTFlowStream` decodes an utterance chunk by chunk instead (the reference's setup_cache + inference_chunk): the
encoder and the DiT keep caches (flow_encoder_v2.py, DiT.forward_chunk), one DiT cache per Euler step since each
step's keys and values depend on that step's x. A chunk attends to every earlier frame, prompt included, so it
matches the whole-utterance mel only approximately (there every frame also sees the later ones).

The token encoder is the reference's `UpsampleConformerEncoderV2`. Over a whole utterance it is the same network,
with the same state-dict names, as CosyVoice2's `UpsampleConformerEncoder` with full attention and no lookahead
context, so ours (flow_encoder.py) runs it. V2 only differs in how it streams (attention caches instead of chunk
masks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from voxbackend.components.flow_hift.dit_estimator import BlockCache, DiT, DiTConfig
from voxbackend.components.flow_hift.flow_encoder import EncoderConfig, UpsampleConformerEncoder
from voxbackend.components.flow_hift.flow_encoder_v2 import EncoderCache, encode_chunk
from voxbackend.components.flow_hift.flow_matching import solve_euler_cfg


@dataclass(frozen=True)
class DiTFlowConfig:
    vocab_size: int = 6561
    mel_bins: int = 80
    spk_embed_dim: int = 192
    n_timesteps: int = 10
    cfg_rate: float = 0.7               # inference classifier-free guidance
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: DiTConfig = field(default_factory=DiTConfig)


class Decoder(nn.Module):
    """Holds the estimator under the reference's `decoder.estimator` name."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.estimator = DiT(cfg)


class DiTFlow(nn.Module):
    def __init__(self, cfg: DiTFlowConfig):
        super().__init__()
        self.cfg = cfg
        size = cfg.encoder.size
        self.input_embedding = nn.Embedding(cfg.vocab_size, size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(size, cfg.mel_bins)
        self.decoder = Decoder(cfg.estimator)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
                embedding: torch.Tensor, noise: torch.Tensor | torch.Generator) -> torch.Tensor:
        """tokens: (N,) long; prompt_tokens: (P,) long (may be empty); prompt_feat: (P_mel, mel_bins) prompt mel,
        P_mel <= upsample * P; embedding: (spk_embed_dim,) speaker vector; noise: (mel_bins, >= frames) initial
        noise, or a generator to draw it. Returns the mel after the prompt: (mel_bins, upsample * (P + N) - P_mel)."""
        cfg, device = self.cfg, self.input_embedding.weight.device
        dtype = self.input_embedding.weight.dtype
        all_tokens = torch.cat([prompt_tokens, tokens]).to(device).clamp(min=0)
        n_tokens = all_tokens.numel()
        n_prompt_mel = prompt_feat.size(0)
        frames = n_tokens * cfg.encoder.upsample
        if n_prompt_mel > frames:
            raise ValueError(f"prompt mel ({n_prompt_mel} frames) is longer than the tokens' {frames} frames")
        lengths = torch.tensor([n_tokens], device=device)
        h = self.encoder(self.input_embedding(all_tokens)[None], lengths, torch.zeros_like(lengths),
                         torch.zeros(1, dtype=torch.bool, device=device), n_tokens)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()      # (1, mel, frames)
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(device, dtype)[None], dim=1))
        cond = torch.zeros_like(mu)
        cond[0, :, :n_prompt_mel] = prompt_feat.to(device, dtype).T
        mask = torch.ones(1, 1, frames, device=device, dtype=dtype)
        if isinstance(noise, torch.Generator):
            x = torch.randn(cfg.mel_bins, frames, generator=noise, device=noise.device)
        else:
            x = noise[:, :frames]
        x = x.to(device, torch.float32)[None]
        mask2, mu2 = torch.cat([mask, mask]), torch.cat([mu, torch.zeros_like(mu)])
        spks2, cond2 = torch.cat([spks, torch.zeros_like(spks)]), torch.cat([cond, torch.zeros_like(cond)])

        def velocity(x2: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
            return self.decoder.estimator(x2.to(dtype), mask2, mu2, t2, spks2, cond2)

        mel = solve_euler_cfg(velocity, x, cfg.n_timesteps, cfg.cfg_rate)
        return mel[0, :, n_prompt_mel:]


class DiTFlowStream:
    """One utterance decoded chunk by chunk. The prompt runs first, as a chunk of its own: its tokens plus
    pre_lookahead_len lookahead tokens (the reference passes the prompt's first ones again), its mel as `cond`.
    Every later chunk is its tokens plus the lookahead tokens that open the next chunk, except the last."""

    @torch.inference_mode()
    def __init__(self, flow: DiTFlow, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, noise: torch.Tensor):
        """prompt_tokens: (P + lookahead,) long; prompt_feat: (upsample * P, mel_bins); embedding: (spk_embed_dim,);
        noise: (mel_bins, frames) for the whole utterance, prompt included, indexed by frame."""
        cfg = flow.cfg
        if (len(prompt_tokens) - cfg.encoder.pre_lookahead_len) * cfg.encoder.upsample != prompt_feat.size(0):
            raise ValueError("the prompt mel must cover the prompt tokens (without their lookahead) exactly")
        self.flow, self.noise = flow, noise
        weight = flow.input_embedding.weight
        self.spks = flow.spk_embed_affine_layer(F.normalize(embedding.to(weight.device, weight.dtype)[None], dim=1))
        self.frames = 0                                 # mel frames decoded so far, prompt included
        self.encoder_cache: EncoderCache | None = None
        self.step_caches: list[list[BlockCache]] | None = None
        self._decode(prompt_tokens, prompt_feat.T, last_chunk=False)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, last_chunk: bool = False) -> torch.Tensor:
        """tokens: (N,) long, lookahead included unless last_chunk. Returns the chunk's mel (mel_bins, frames)."""
        return self._decode(tokens, None, last_chunk)

    def _decode(self, tokens: torch.Tensor, cond: torch.Tensor | None, last_chunk: bool) -> torch.Tensor:
        flow, cfg = self.flow, self.flow.cfg
        weight = flow.input_embedding.weight
        x = flow.input_embedding(tokens.to(weight.device).clamp(min=0))[None]
        h, self.encoder_cache = encode_chunk(flow.encoder, x, self.encoder_cache, last_chunk)
        mu = flow.encoder_proj(h).transpose(1, 2).contiguous()     # (1, mel, frames)
        frames = mu.size(-1)
        cond = torch.zeros_like(mu) if cond is None else cond.to(mu)[None]
        if self.frames + frames > self.noise.size(-1):
            raise ValueError(f"{self.frames + frames} mel frames exceed the noise ({self.noise.size(-1)})")
        x = self.noise[:, self.frames:self.frames + frames].to(weight.device, torch.float32)[None]
        mu2, cond2 = torch.cat([mu, torch.zeros_like(mu)]), torch.cat([cond, torch.zeros_like(cond)])
        spks2 = torch.cat([self.spks, torch.zeros_like(self.spks)])
        past = self.step_caches or [None] * cfg.n_timesteps
        new_caches = []

        def velocity(x2: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
            v, cache = flow.decoder.estimator.forward_chunk(x2.to(weight.dtype), mu2, t2, spks2, cond2,
                                                            past[len(new_caches)])
            new_caches.append(cache)
            return v

        mel = solve_euler_cfg(velocity, x, cfg.n_timesteps, cfg.cfg_rate)
        self.step_caches, self.frames = new_caches, self.frames + frames
        return mel[0]
