"""CosyVoice 1's `InterpolateRegulator` as GLM-4-Voice's flow runs it (its `forward`, for inference too): the
encoder's token-rate features stretched to the mel frame count by nearest-neighbour interpolation over the whole
sequence, prompt included, then (conv k3 + GroupNorm + Mish) stages and a 1x1 conv.

The mel frame count is upstream's `int(tokens / input_frame_rate * 22050 / 256)`, evaluated in float32 as upstream
evaluates it on a tensor; the nearest source index is torch's (`floor(j * float32(in / out))`), computed per row so
that rows of different lengths share a batch (every conv input is masked and GroupNorm counts valid frames only).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from voxbackend.components.flow_hift.unet_estimator import MaskedGroupNorm


def mel_frames(token_counts: list[int], token_rate: float, sample_rate: int, hop: int) -> list[int]:
    """Mel frames for each count of tokens, with upstream's float32 rounding (numpy on the host: the counts are
    known there, and a device tensor would cost a wait for it)."""
    f32 = np.float32
    counts = np.asarray(token_counts, dtype=np.int32).astype(f32)
    return (counts / f32(token_rate) * f32(sample_rate) / f32(hop)).astype(np.int32).tolist()


def nearest_source(in_lengths: torch.Tensor, out_lengths: torch.Tensor, total: int) -> torch.Tensor:
    """(B, total) long: for output frame j of row b, the input index F.interpolate(mode="nearest") would read."""
    scale = in_lengths.float() / out_lengths.float()
    index = (torch.arange(total, device=in_lengths.device, dtype=torch.float32)[None] * scale[:, None]).floor()
    return torch.minimum(index.long(), in_lengths[:, None] - 1)


class InterpolateRegulator(nn.Module):
    def __init__(self, channels: int, stages: int, groups: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(stages):
            layers += [nn.Conv1d(channels, channels, 3, 1, 1), MaskedGroupNorm(groups, channels), nn.Mish()]
        layers.append(nn.Conv1d(channels, channels, 1, 1))
        self.model = nn.Sequential(*layers)     # the reference's indices, for its state-dict names
        self.stages = stages

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, frames: torch.Tensor, total: int) -> torch.Tensor:
        """x: (B, T, C) valid for lengths[b] tokens. Returns (B, C, total), row b valid (and nonzero) for frames[b]."""
        index = nearest_source(lengths, frames, total)
        h = x.gather(1, index[:, :, None].expand(-1, -1, x.size(2))).transpose(1, 2)
        mask = (torch.arange(total, device=x.device)[None] < frames[:, None]).to(x.dtype).unsqueeze(1)
        for i in range(self.stages):
            conv, norm = self.model[3 * i], self.model[3 * i + 1]
            h = F.mish(norm(conv(h * mask), mask))
        return self.model[-1](h) * mask
