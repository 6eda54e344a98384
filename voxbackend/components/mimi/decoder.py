"""Mimi decoder (Kyutai's 24 kHz, 12.5 Hz codec; CSM-1B's detokenizer) with per-request streaming state.

Loads the Hugging Face `MimiModel` checkpoint layout (kyutai/mimi: config.json + *.safetensors with the flat
`quantizer.*`, `upsample.*`, `decoder_transformer.*`, `decoder.layers.*` names); the encoder half is ignored.
One codec frame: 32 codebook lookups -> 1x1 output projections -> depthwise transposed-conv upsample to 25 Hz ->
causal sliding-window transformer -> causal SEANet decoder (x8 x6 x5 x4) -> 1920 samples at 24 kHz.

Every stage is causal, so streaming is exact. A request's `MimiStreamState` is one flat tensor holding
  * for each causal conv, its last (effective kernel - 1) inputs: the left context a one-shot decode would see;
  * for each transposed conv, the overlap tail (kernel - stride outputs, bias removed) not yet emitted;
  * for each transformer layer, the rotated keys and values of the last (window - 1) steps;
plus the host-side frame count, which gives the RoPE positions and tells which KV slots hold real steps.

The transformer's window has two modes (see MimiDecoder): "exact" (default; training, transformers and moshi's
one-shot decode) and "moshi" (moshi's frame-by-frame streaming decoder, which differs once a stream is past the
window). Both are defined per step, not per call, so neither depends on how a stream is chunked.

Batching: rows are different requests, at any stream positions. Each state has the same fixed size (the KV part
always has window - 1 slots; slots before a request's first step are masked out by position), so rows of any age
stack into one [B, numel] batch with no padding or grouping, and positions and the window mask are per row.
A batch of one works on the request's own tensor in place; larger batches stack the rows (one copy) and copy
them back after the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from voxbackend.components.mimi.weights import (
    codebook_tables, flat_names, frame_size, read_codec_config, read_codec_tensors,
)


@dataclass
class MimiStreamState:
    """Everything one request's decoder carries between chunks (from MimiDecoder.new_state; decode its frames in
    order, one call at a time)."""
    buf: torch.Tensor   # [state_numel]: conv contexts, conv-transpose tails and KV windows, laid out by the decoder
    frames: int = 0     # codec frames decoded so far


class _Layout:
    """Hands out slices of the flat per-request state buffer to the modules that need one."""

    def __init__(self):
        self.numel = 0

    def take(self, *shape: int) -> tuple[int, tuple[int, ...]]:
        off, self.numel = self.numel, self.numel + math.prod(shape)
        return off, shape


def _piece(buf: torch.Tensor, slot: tuple[int, tuple[int, ...]]) -> torch.Tensor:
    off, shape = slot  # a view into the batch's state buffer [B, numel]
    return buf[:, off:off + math.prod(shape)].view(buf.shape[0], *shape)


def _rows_window(x: torch.Tensor, starts: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """x[b, ..., starts[b]:starts[b] + n, ...] along `dim` for every row b: each row's own slice."""
    x = x.movedim(dim, -1)
    idx = starts.view(-1, *([1] * (x.dim() - 1))) + torch.arange(n, device=x.device)
    return x.gather(-1, idx.expand(*x.shape[:-1], n)).movedim(-1, dim)


class CausalConv1d(nn.Module):
    """Stride-1 causal conv: left-pads with the inputs it saw last time (zeros at the stream start).

    `ends` (optional, [B]): how many of the T input steps are real in each row; the rest is right padding of a
    batch of unequal windows, whose outputs the caller drops and which must not enter the carried context."""

    def __init__(self, cin: int, cout: int, kernel: int, layout: _Layout, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.ctx = (kernel - 1) * dilation
        self.slot = layout.take(cin, self.ctx) if self.ctx else None

    def forward(self, x: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor | None = None) -> torch.Tensor:
        if self.slot is None:
            return self.conv(x)
        prev = _piece(buf, self.slot)
        x = torch.cat([prev, x], dim=-1)
        prev.copy_(x[..., x.shape[-1] - self.ctx:] if ends is None else _rows_window(x, ends, self.ctx))
        return self.conv(x)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv trimmed on the right; the trimmed overlap is added to the next chunk's first outputs."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, layout: _Layout, groups: int = 1,
                 bias: bool = True):
        super().__init__()
        assert kernel <= 2 * stride, "the overlap tail must fit in one input step's output"
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride, groups=groups, bias=bias)
        self.stride, self.tail = stride, kernel - stride
        self.slot = layout.take(cout, self.tail) if self.tail else None

    def forward(self, x: torch.Tensor, buf: torch.Tensor, ends: torch.Tensor | None = None) -> torch.Tensor:
        """`ends` as in CausalConv1d; padding steps are zeroed so that they add nothing to a row's tail."""
        if ends is not None and self.slot is not None:
            x = x * (torch.arange(x.shape[-1], device=x.device) < ends[:, None])[:, None].to(x.dtype)
        y = self.conv(x)  # [B, C, (T - 1) * stride + kernel]
        n = x.shape[-1] * self.stride
        if self.slot is None:
            return y
        tail = _piece(buf, self.slot)
        y[..., :self.tail] += tail
        rest = y[..., n:] if ends is None else _rows_window(y, ends * self.stride, self.tail)
        # the next chunk's outputs already carry the bias once
        tail.copy_(rest if self.conv.bias is None else rest - self.conv.bias[:, None])
        return y[..., :n]


class ResnetBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int, layout: _Layout):
        super().__init__()
        self.block = nn.ModuleList([nn.ELU(), CausalConv1d(dim, hidden, kernel, layout, dilation),
                                    nn.ELU(), CausalConv1d(hidden, dim, 1, layout)])  # indices as in the checkpoint

    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = x
        for m in self.block:
            y = m(y, buf) if isinstance(m, CausalConv1d) else m(y)
        return x + y


class SeanetDecoder(nn.Module):
    def __init__(self, cfg: dict, layout: _Layout):
        super().__init__()
        nf, ratios = cfg["num_filters"], cfg["upsampling_ratios"]
        scale = 2 ** len(ratios)
        layers: list[nn.Module] = [CausalConv1d(cfg["hidden_size"], scale * nf, cfg["kernel_size"], layout)]
        for r in ratios:
            c = scale * nf
            layers += [nn.ELU(), CausalConvTranspose1d(c, c // 2, 2 * r, r, layout)]
            layers += [ResnetBlock(c // 2, c // 2 // cfg["compress"], cfg["residual_kernel_size"],
                                   cfg["dilation_growth_rate"] ** j, layout) for j in range(cfg["num_residual_layers"])]
            scale //= 2
        layers += [nn.ELU(), CausalConv1d(nf, cfg["audio_channels"], cfg["last_kernel_size"], layout)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x) if isinstance(m, nn.ELU) else m(x, buf)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # half-split RoPE: the HF checkpoint's q/k rows are already permuted from Kyutai's interleaved layout
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class AttentionProjections(nn.Module):
    """Mimi's attention weights (transformers' MimiAttention names), RoPE on q and k, and the attention itself;
    the streaming decoder adds its key/value cache, the whole-clip encoder uses it as it is."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or d // self.heads
        bias = cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=bias)

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] -> q [B, heads, T, head_dim] and k, v [B, kv_heads, T, head_dim], q and k rotated."""
        B, T, _ = x.shape
        q = _rotate(self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


def rope_inv_freq(cfg: dict, head_dim: int) -> torch.Tensor:
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    assert rope.get("rope_type", "default") == "default"
    return 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)


class Attention(AttentionProjections):
    def __init__(self, cfg: dict, layout: _Layout):
        super().__init__(cfg)
        self.keep = cfg["sliding_window"] - 1  # a query sees itself and the window - 1 steps before it
        self.k_slot = layout.take(self.kv_heads, self.keep, self.head_dim)
        self.v_slot = layout.take(self.kv_heads, self.keep, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                buf: torch.Tensor, ends: torch.Tensor | None = None) -> torch.Tensor:
        """`ends` as in CausalConv1d: the cache keeps the last window - 1 real steps of each row."""
        q, k, v = self.rotated_qkv(x, cos, sin)
        k_cache, v_cache = _piece(buf, self.k_slot), _piece(buf, self.v_slot)
        k, v = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)  # key j is at step base + j
        if ends is None:
            k_cache.copy_(k[:, :, k.shape[2] - self.keep:])
            v_cache.copy_(v[:, :, v.shape[2] - self.keep:])
        else:
            k_cache.copy_(_rows_window(k, ends, self.keep, dim=2))
            v_cache.copy_(_rows_window(v, ends, self.keep, dim=2))
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        assert cfg.get("hidden_act", "gelu") == "gelu"
        self.fc1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=False)
        self.fc2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: dict, layout: _Layout):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg.get("norm_eps", 1e-5)
        self.input_layernorm = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(cfg, layout)
        self.self_attn_layer_scale = LayerScale(d)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(cfg)
        self.mlp_layer_scale = LayerScale(d)

    def forward(self, x, cos, sin, mask, buf):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, buf))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: dict, layout: _Layout, window_group: int = 1):
        super().__init__()
        self.window = cfg["sliding_window"]
        self.group = window_group  # the window ends at the last step of the query's group (see MimiDecoder)
        assert self.window and self.window >= 2
        self.layers = nn.ModuleList([TransformerLayer(cfg, layout) for _ in range(cfg["num_hidden_layers"])])
        self.register_buffer("inv_freq", rope_inv_freq(cfg, self.layers[0].self_attn.head_dim), persistent=False)

    def forward(self, x: torch.Tensor, start: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """x [B, T, C]; start [B]: each row's first step index in this chunk."""
        cos, sin, mask = window_attention_inputs(start, x.shape[1], self.window, self.inv_freq, x.dtype, self.group)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, buf)
        return x


def window_attention_inputs(start: torch.Tensor, T: int, window: int, inv_freq: torch.Tensor, dtype: torch.dtype,
                            group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE cos/sin [B, 1, T, head_dim] for the queries of a chunk whose row b starts at step start[b], and the
    mask [B, 1, T, window - 1 + T] over [the window - 1 cached keys, the chunk's keys] (see Attention): a query
    sees keys at or before it, none before the stream start, and none `window` or more steps before the last step
    of its group of `group` steps."""
    keep = window - 1
    pos_q = start[:, None] + torch.arange(T, device=start.device)                  # [B, T]
    pos_k = start[:, None] - keep + torch.arange(keep + T, device=start.device)     # [B, keep + T]
    last = (pos_q // group * group + group - 1)[:, :, None]
    mask = ((pos_k[:, None] >= 0) & (pos_k[:, None] <= pos_q[:, :, None]) & (last - pos_k[:, None] < window))[:, None]
    freqs = pos_q[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]                               # [B, 1, T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype), mask


class MimiDecoder(nn.Module):
    """window_mode "exact": each transformer step attends to itself and the sliding_window - 1 steps before it,
    as in training, transformers' MimiModel and moshi's one-shot decode. "moshi": what moshi's streaming decoder
    computes when fed one frame per call: its ring KV cache holds exactly sliding_window steps and takes the whole
    frame's keys before attending, so a frame's first step loses its oldest key once the stream passes the
    window (10 s for kyutai/mimi). Both are causal and give the same audio for any chunking."""

    def __init__(self, cfg: dict, window_mode: str = "exact"):
        super().__init__()
        assert window_mode in ("exact", "moshi")
        self.window_mode = window_mode
        assert cfg.get("use_causal_conv", True) and cfg.get("pad_mode", "constant") == "constant"
        assert cfg.get("trim_right_ratio", 1.0) == 1.0 and not cfg.get("use_conv_shortcut", False)
        self.config = cfg
        self.sample_rate: int = cfg["sampling_rate"]
        self.num_codebooks: int = cfg["num_quantizers"]
        self.num_semantic: int = cfg.get("num_semantic_quantizers", 1)
        self.codebook_size: int = cfg["codebook_size"]
        self.frame_size: int = frame_size(cfg)
        self.latent_stride = self.frame_size // math.prod(cfg["upsampling_ratios"])  # transformer steps per frame
        self.frame_rate = self.sample_rate / self.frame_size
        d, dq = cfg["hidden_size"], cfg.get("vector_quantization_hidden_dimension", 256)
        # codebook k entry c sits at row k * codebook_size + c; filled from embed_sum / cluster_usage at load
        self.register_buffer("codebooks", torch.zeros(self.num_codebooks * self.codebook_size, dq))
        self.register_buffer("offsets", torch.arange(self.num_codebooks) * self.codebook_size, persistent=False)
        self.semantic_proj = nn.Linear(dq, d, bias=False) if dq != d else nn.Identity()
        self.acoustic_proj = nn.Linear(dq, d, bias=False) if dq != d else nn.Identity()
        layout = _Layout()
        self.upsample = (CausalConvTranspose1d(d, d, 2 * self.latent_stride, self.latent_stride, layout,
                                               groups=cfg.get("upsample_groups", d), bias=False)
                         if self.latent_stride > 1 else None)
        self.decoder_transformer = Transformer(cfg, layout, self.latent_stride if window_mode == "moshi" else 1)
        self.decoder = SeanetDecoder(cfg, layout)
        self.state_numel = layout.numel

    # ---- loading ----
    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        prefix: str = "", window_mode: str = "exact") -> "MimiDecoder":
        """A Mimi folder (config.json + safetensors). `prefix` selects a codec inside a bigger checkpoint (e.g.
        "codec_model." in a CSM folder, whose config.json then holds the Mimi config under "codec_config")."""
        path = Path(path)
        model = cls(read_codec_config(path), window_mode)
        model.load_hf_weights(read_codec_tensors(path, prefix))
        return model.to(device=device, dtype=dtype).eval()

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        w = flat_names(weights)
        own: dict[str, torch.Tensor] = {
            "codebooks": torch.cat(codebook_tables(w, self.num_semantic, self.num_codebooks))}
        for part in ("semantic", "acoustic"):
            if isinstance(getattr(self, f"{part}_proj"), nn.Linear):
                own[f"{part}_proj.weight"] = w[f"quantizer.{part}_residual_vector_quantizer.output_proj.weight"][..., 0]
        keep = ("upsample.", "decoder_transformer.", "decoder.")
        own.update({k: v for k, v in w.items() if k.startswith(keep)})
        self.load_state_dict(own, strict=True)

    # ---- streaming ----
    def new_state(self) -> MimiStreamState:
        w = self.decoder.layers[0].conv.weight
        return MimiStreamState(torch.zeros(self.state_numel, device=w.device, dtype=w.dtype))

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, T] (K <= num_codebooks) -> quantized latents [B, hidden, T]."""
        K = codes.shape[1]
        emb = F.embedding(codes + self.offsets[:K, None], self.codebooks)  # [B, K, T, dq]
        z = self.semantic_proj(emb[:, :self.num_semantic].sum(1))
        if K > self.num_semantic:
            z = z + self.acoustic_proj(emb[:, self.num_semantic:].sum(1))
        return z.transpose(1, 2)

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor, states: list[MimiStreamState]) -> torch.Tensor:
        """codes [B, K, frames], row b continuing states[b] (rows are different requests, any ages).
        Returns audio [B, channels, frames * frame_size] and advances every state in place."""
        B, _, T = codes.shape
        assert B == len(states) == len({id(s) for s in states}) and T > 0, "one row per request"
        buf = states[0].buf.view(1, -1) if B == 1 else torch.stack([s.buf for s in states])
        start = torch.tensor([s.frames * self.latent_stride for s in states], device=buf.device)
        x = self.latents(codes.to(self.codebooks.device)).to(buf.dtype)
        if self.upsample is not None:
            x = self.upsample(x, buf)
        x = self.decoder_transformer(x.transpose(1, 2), start, buf).transpose(1, 2)
        audio = self.decoder(x, buf)
        for b, s in enumerate(states):
            if B > 1:
                s.buf.copy_(buf[b])
            s.frames += T
        return audio

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """All frames at once from a fresh state: [B, K, T] -> [B, channels, T * frame_size]."""
        return self.decode_chunk(codes, [self.new_state() for _ in range(codes.shape[0])])
