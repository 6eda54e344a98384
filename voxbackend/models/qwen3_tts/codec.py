"""Qwen3-TTS 12 Hz speech tokenizer ("tokenizer v2") decoder with per-request streaming state.

Loads the official speech-tokenizer folder (`speech_tokenizer/` of a Qwen3-TTS-12Hz checkpoint: config.json with
a `decoder_config`, model.safetensors with the decoder under `decoder.*`; the Mimi encoder half is ignored here).
One codec frame (12.5 Hz) of 16 codes becomes 1920 samples at 24 kHz:

  split RVQ (codebook 0 and codebooks 1-15, each half summed and projected 1x1) -> causal conv (k 3)
  -> 8-layer transformer (RMSNorm, SwiGLU, layer scales, RoPE) with a 72-frame sliding window, at the frame rate
  -> 2 x [causal transposed conv x2 + ConvNeXt block (causal depthwise k 7)]
  -> causal conv (k 7) -> 4 x [SnakeBeta, causal transposed conv (x8 x5 x4 x3), 3 residual units
     (dilations 1, 3, 9)] -> SnakeBeta -> causal conv to 1 channel -> clamp to [-1, 1].

Every stage is causal, so streaming is exact (not the reference's 300-frame chunks with 25 frames of context,
which differ from a whole-clip decode). A stream's `Qwen3TTSCodecState` is one flat tensor laid out as in
`voxbackend.components.mimi.decoder`: each causal conv's last (effective kernel - 1) inputs, each transposed conv's
overlap
tail, and each layer's rotated keys and values of the last 71 frames; plus the frame count (RoPE positions).

Batching: `decode_window` takes windows of different streams, of any lengths and ages, in one pass. Windows are
right-padded to the longest; causality keeps padding out of the real outputs, and every stateful piece carries
forward only its row's real steps (the `ends` argument of the Mimi pieces). A call costs rows x longest window,
so a scheduler should batch windows of similar lengths.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.mimi.decoder import (
    Attention, CausalConv1d, CausalConvTranspose1d, LayerScale, _Layout, window_attention_inputs,
)
from voxbackend.components.mimi.weights import read_codec_tensors
from voxbackend.models.decoder import RMSNorm

# Qwen3TTSTokenizerV2DecoderConfig's defaults (the released checkpoint states every field except head_dim's
# fallback); codebook_dim has no default there, 512 is the released value.
DECODER_DEFAULTS = dict(
    codebook_size=2048, codebook_dim=512, hidden_size=1024, latent_dim=1024, rope_theta=10000.0,
    num_attention_heads=16, num_key_value_heads=16, attention_bias=False, sliding_window=72,
    intermediate_size=3072, hidden_act="silu", rms_norm_eps=1e-5, num_hidden_layers=8, num_quantizers=16,
    upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=1536,
)
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
KERNEL = 7  # the synthesis stages' causal convs (ConvNeXt depthwise, decoder input / output, residual units)
DILATIONS = (1, 3, 9)  # of each decoder block's residual units


def synthesis_reach_frames(d: dict) -> int:
    """How many frames back the stages after the transformer see (upsampling, ConvNeXt and the conv decoder:
    feed-forward causal convolutions): each conv's reach, at its stage's steps per frame, summed; rounded up,
    plus one frame of margin. Their state after a run of at least this many frames does not depend on what
    came before it."""
    steps, reach = 1, 0.0
    for r in d["upsampling_ratios"]:  # transposed conv with kernel = stride (no overlap), then ConvNeXt
        steps *= r
        reach += (KERNEL - 1) / steps
    reach += (KERNEL - 1) / steps  # decoder input conv
    for r in d["upsample_rates"]:
        reach += 1 / steps  # transposed conv, kernel 2r, stride r: the previous input step's overlap
        steps *= r
        reach += (KERNEL - 1) * sum(DILATIONS) / steps
    reach += (KERNEL - 1) / steps  # output conv
    return math.ceil(reach) + 1


@dataclass
class Qwen3TTSCodecState:
    """Everything one stream's decoder carries between windows (from Qwen3TTSCodec.new_state; decode its frames in
    order, at most one window per call)."""
    buf: torch.Tensor   # [state_numel]: conv contexts, transposed-conv tails and KV windows
    frames: int = 0     # codec frames decoded so far


def read_speech_tokenizer(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(top-level config with `decoder_config` completed from the defaults, decoder tensors without "decoder.").
    `path` is the speech-tokenizer folder or a Qwen3-TTS checkpoint folder holding it as `speech_tokenizer/`."""
    path = Path(path)
    if not (path / "config.json").exists() or (path / "speech_tokenizer" / "config.json").exists():
        path = path / "speech_tokenizer"
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") != "qwen3_tts_tokenizer_12hz":
        raise ValueError(f"{path}: model_type {cfg.get('model_type')!r} is not the 12 Hz tokenizer "
                         "('qwen3_tts_tokenizer_12hz')")
    cfg["decoder_config"] = {**DECODER_DEFAULTS, **(cfg.get("decoder_config") or {})}
    return cfg, read_codec_tensors(path, "decoder.")


class SnakeBeta(nn.Module):
    """x + sin^2(x e^alpha) / e^beta, per channel (alpha and beta stored as logs)."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, inv_beta = self.alpha.exp()[:, None], 1.0 / (self.beta.exp()[:, None] + 1e-9)  # per channel, once
        return x + torch.sin(x * alpha).pow(2) * inv_beta


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, layout: _Layout):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, KERNEL, layout, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x, buf, ends).transpose(1, 2)
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + y.transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, layout: _Layout):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, KERNEL, layout, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1, layout)

    def forward(self, x: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), buf, ends)), buf, ends)


class DecoderBlock(nn.Module):
    """SnakeBeta, then an x`rate` causal transposed conv halving the channels, then three residual units."""

    def __init__(self, cin: int, rate: int, layout: _Layout):
        super().__init__()
        cout = cin // 2
        self.rate = rate
        self.block = nn.ModuleList([SnakeBeta(cin), CausalConvTranspose1d(cin, cout, 2 * rate, rate, layout)]
                                   + [ResidualUnit(cout, d, layout) for d in DILATIONS])  # indices as checkpoint

    def forward(self, x: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """`ends` counts this block's input steps; its outputs are `rate` times as many."""
        x = self.block[1](self.block[0](x), buf, ends)
        for unit in self.block[2:]:
            x = unit(x, buf, ends * self.rate)
        return x


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, hidden = cfg["hidden_size"], cfg["intermediate_size"]
        if cfg["hidden_act"] not in _ACTIVATIONS:
            raise ValueError(f"decoder_config.hidden_act {cfg['hidden_act']!r}: expected one of {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[cfg["hidden_act"]]
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: dict, layout: _Layout):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(cfg, layout)
        self.self_attn_layer_scale = LayerScale(d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(cfg)
        self.mlp_layer_scale = LayerScale(d)

    def forward(self, x, cos, sin, mask, buf, ends):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, buf, ends))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """The sliding-window transformer between the first conv and the upsampling, one step per codec frame."""

    def __init__(self, cfg: dict, layout: _Layout):
        super().__init__()
        self.window = cfg["sliding_window"]
        if not self.window or self.window < 2:
            raise ValueError(f"decoder_config.sliding_window {self.window!r}: expected at least 2")
        self.input_proj = nn.Linear(cfg["latent_dim"], cfg["hidden_size"])
        self.layers = nn.ModuleList([TransformerLayer(cfg, layout) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.output_proj = nn.Linear(cfg["hidden_size"], cfg["latent_dim"])
        head_dim = self.layers[0].self_attn.head_dim
        self.register_buffer("inv_freq", 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)

    def forward(self, x: torch.Tensor, start: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [B, T, latent]; start [B]: each row's first frame index; ends [B]: its real frames in this window."""
        x = self.input_proj(x)
        cos, sin, mask = window_attention_inputs(start, x.shape[1], self.window, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, buf, ends)
        return self.output_proj(self.norm(x))


class Qwen3TTSCodec(nn.Module):
    """The 12 Hz tokenizer's decoder: codes [B, T, 16] -> audio [B, T * 1920], whole clips or stream by stream."""

    def __init__(self, cfg: dict):
        """`cfg`: the speech-tokenizer config.json (as from read_speech_tokenizer)."""
        super().__init__()
        d = {**DECODER_DEFAULTS, **cfg["decoder_config"]}
        self.config = d
        self.sample_rate: int = cfg.get("output_sample_rate", 24000)
        self.num_codebooks: int = d["num_quantizers"]
        self.codebook_size: int = d["codebook_size"]
        self.frame_size: int = math.prod(d["upsample_rates"]) * math.prod(d["upsampling_ratios"])
        if self.frame_size != cfg.get("decode_upsample_rate", self.frame_size):
            raise ValueError(f"decode_upsample_rate {cfg['decode_upsample_rate']} != the product of upsample_rates "
                             f"and upsampling_ratios ({self.frame_size})")
        self.frame_rate = self.sample_rate / self.frame_size
        dq, latent = d["codebook_dim"] // 2, d["latent_dim"]
        # codebook k entry c sits at row k * codebook_size + c; codebook 0 is the semantic one (its own projection)
        self.register_buffer("codebooks", torch.zeros(self.num_codebooks * self.codebook_size, dq))
        self.register_buffer("offsets", torch.arange(self.num_codebooks) * self.codebook_size, persistent=False)
        self.semantic_proj = nn.Linear(dq, d["codebook_dim"], bias=False)
        self.acoustic_proj = nn.Linear(dq, d["codebook_dim"], bias=False)
        layout = _Layout()
        self.pre_conv = CausalConv1d(d["codebook_dim"], latent, 3, layout)
        self.pre_transformer = PreTransformer(d, layout)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(latent, latent, r, r, layout), ConvNeXtBlock(latent, layout)])
            for r in d["upsampling_ratios"])
        dim = d["decoder_dim"]
        blocks: list[nn.Module] = [CausalConv1d(latent, dim, KERNEL, layout)]
        for i, rate in enumerate(d["upsample_rates"]):
            blocks.append(DecoderBlock(dim // 2 ** i, rate, layout))
        out_dim = dim // 2 ** len(d["upsample_rates"])
        blocks += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, KERNEL, layout)]
        self.decoder = nn.ModuleList(blocks)
        self.state_numel = layout.numel
        self.reach_frames = synthesis_reach_frames(d)

    # ---- loading ----
    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "Qwen3TTSCodec":
        """The speech-tokenizer folder, or a Qwen3-TTS checkpoint folder with it as `speech_tokenizer/`."""
        cfg, weights = read_speech_tokenizer(path)
        model = cls(cfg)
        model.load_official_weights(weights)
        return model.to(device=device, dtype=dtype).eval()

    def load_official_weights(self, w: dict[str, torch.Tensor]) -> None:
        """Tensors named as in Qwen3TTSTokenizerV2Decoder's state dict (the checkpoint's `decoder.*`)."""
        tables = []
        for part, n in (("rvq_first", 1), ("rvq_rest", self.num_codebooks - 1)):
            for i in range(n):
                cb = f"quantizer.{part}.vq.layers.{i}._codebook."
                usage = w[cb + "cluster_usage"].float().clamp(min=1e-5)
                tables.append(w[cb + "embedding_sum"].float() / usage[:, None])
        own: dict[str, torch.Tensor] = {
            "codebooks": torch.cat(tables),
            "semantic_proj.weight": w["quantizer.rvq_first.output_proj.weight"][..., 0],
            "acoustic_proj.weight": w["quantizer.rvq_rest.output_proj.weight"][..., 0],
        }
        own.update({k: v for k, v in w.items() if k.startswith(("pre_conv.", "pre_transformer.", "upsample.",
                                                                   "decoder."))})
        self.load_state_dict(own, strict=True)

    # ---- decoding ----
    def new_state(self) -> Qwen3TTSCodecState:
        w = self.pre_conv.conv.weight
        return Qwen3TTSCodecState(torch.zeros(self.state_numel, device=w.device, dtype=w.dtype))

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, 16] -> quantized latents [B, codebook_dim, T]."""
        emb = F.embedding(codes + self.offsets, self.codebooks)  # [B, T, 16, dq]
        return (self.semantic_proj(emb[:, :, 0]) + self.acoustic_proj(emb[:, :, 1:].sum(2))).transpose(1, 2)

    @torch.inference_mode()
    def decode_window(self, states: list[Qwen3TTSCodecState], windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """windows[i] [T_i, 16] continues stream states[i] (distinct streams, any ages, any T_i >= 0).
        Returns each window's audio [T_i * 1920] and advances every state in place."""
        if len(states) != len(windows) or len({id(s) for s in states}) != len(states):
            raise ValueError("decode_window takes one window per stream, each stream once")
        for codes in windows:
            self._check_shape(codes, 2)
        rows = [i for i, c in enumerate(windows) if c.shape[0] > 0]
        out = [torch.zeros(0, dtype=self.codebooks.dtype, device=self.codebooks.device) for _ in windows]
        if not rows:
            return out
        lengths = [windows[i].shape[0] for i in rows]
        T = max(lengths)
        codes = torch.zeros(len(rows), T, self.num_codebooks, dtype=torch.long, device=self.codebooks.device)
        for b, i in enumerate(rows):
            codes[b, :lengths[b]] = windows[i]
        self._check_values(codes)
        audio = self._run(codes, [states[i] for i in rows], lengths)
        for b, i in enumerate(rows):
            out[i] = audio[b, :lengths[b] * self.frame_size]
        return out

    @torch.inference_mode()
    def prime(self, state: Qwen3TTSCodecState, codes: torch.Tensor) -> None:
        """Advance one stream's state over codes [T, 16] whose audio is not wanted (a voice clone's reference),
        to where decode_window would leave it: the pre-conv and the transformer see every frame, the synthesis
        stages only the last `reach_frames` (all they remember), so a long reference costs little more than a
        short one."""
        self._check_shape(codes, 2)
        if not codes.shape[0]:
            return
        codes = codes.to(self.codebooks.device)
        self._check_values(codes)
        buf = state.buf.view(1, -1)
        t, tail = codes.shape[0], min(codes.shape[0], self.reach_frames)
        x = self._latent_frames(codes[None], [state], buf, [t])
        self._synthesize(x[..., t - tail:], buf, torch.tensor([tail], device=buf.device))
        state.frames += t

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole clips from fresh states: codes [B, T, 16] -> audio [B, T * 1920]."""
        self._check_shape(codes, 3)
        self._check_values(codes)
        if codes.shape[1] == 0:
            return torch.zeros(codes.shape[0], 0, dtype=self.codebooks.dtype, device=self.codebooks.device)
        return self._run(codes.to(self.codebooks.device), [self.new_state() for _ in range(codes.shape[0])],
                         [codes.shape[1]] * codes.shape[0])

    def _check_shape(self, codes: torch.Tensor, dims: int) -> None:
        if codes.dim() != dims or codes.shape[-1] != self.num_codebooks or codes.is_floating_point():
            raise ValueError(f"codes: expected integers of shape {'[B, T' if dims == 3 else '[T'}, "
                             f"{self.num_codebooks}], got {codes.dtype} {list(codes.shape)}")

    def _check_values(self, codes: torch.Tensor) -> None:
        if codes.numel() and bool(((codes < 0) | (codes >= self.codebook_size)).any()):  # one host sync
            raise ValueError(f"codes: expected values in [0, {self.codebook_size})")

    def _run(self, codes: torch.Tensor, states: list[Qwen3TTSCodecState], lengths: list[int]) -> torch.Tensor:
        """codes [B, T, 16], row b holding lengths[b] real frames of states[b] (then padding) -> [B, T * 1920]."""
        B = codes.shape[0]
        buf = states[0].buf.view(1, -1) if B == 1 else torch.stack([s.buf for s in states])
        x = self._synthesize(self._latent_frames(codes, states, buf, lengths), buf,
                             torch.tensor(lengths, device=buf.device))
        for b, s in enumerate(states):
            if B > 1:
                s.buf.copy_(buf[b])
            s.frames += lengths[b]
        return x

    def _latent_frames(self, codes: torch.Tensor, states: list[Qwen3TTSCodecState], buf: torch.Tensor,
                       lengths: list[int]) -> torch.Tensor:
        """codes [B, T, 16] -> the transformer's outputs [B, latent, T] (frame rate), advancing its state in buf."""
        dev = buf.device
        ends = torch.tensor(lengths, device=dev)
        start = torch.tensor([s.frames for s in states], device=dev)
        x = self.pre_conv(self.latents(codes).to(buf.dtype), buf, ends)
        return self.pre_transformer(x.transpose(1, 2), start, buf, ends).transpose(1, 2)

    def _synthesize(self, x: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Frame-rate latents [B, latent, T], row b with ends[b] real frames -> audio [B, T * frame_size]."""
        for up, block in self.upsample:
            x = up(x, buf, ends)
            ends = ends * up.stride
            x = block(x, buf, ends)
        x = self.decoder[0](x, buf, ends)
        for blk in self.decoder[1:-2]:
            x = blk(x, buf, ends)
            ends = ends * blk.rate
        x = self.decoder[-1](self.decoder[-2](x), buf, ends)
        return x[:, 0].clamp(-1, 1)
