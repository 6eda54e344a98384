"""GLM-4-Voice's speech tokenizer (the `glm-4-voice-tokenizer` folder): 16 kHz speech -> ids in [0, 16384),
12.5 a second, the user-speech tokens of GLM-4-Voice's LM.

Upstream (THUDM/GLM-4-Voice, speech_tokenizer/modeling_whisper.py `WhisperVQEncoder`, loaded and run by
speech_tokenizer/utils.py `load_quantize_encoder` and `extract_speech_token`) is a Whisper-large-v3-shaped encoder
cut at a vector quantizer. With the released config.json:
- two causal convolutions (kernel 3, left padding 2; the second of stride 2: one row per 20 ms) with GELU, then
  Whisper's learned positions;
- the first `quantize_position` (16) of Whisper's 32 pre-norm blocks, no final norm. Attention is block-causal:
  a row sees every earlier row and the rest of its block of `quantize_causal_block_size` (200 rows, 4 s), and no
  padding row;
- after block `pooling_position` (16, the last one) an average pool of `pooling_kernel_size` (4): one row per
  80 ms, then the nearest of `quantize_vocab_size` (16384) codewords.
`extract_speech_token` cuts a clip into 30 s pieces and batches them (128 at most) through WhisperFeatureExtractor
with padding="longest" to a multiple of 1280 samples (one token); a piece's tokens are those whose first sample is
one of its own. That padding reaches the tokens: the last frame reads 40 samples past the padded end, which the
STFT fills by reflection (clip samples when the padding is under 41 samples, zeros when a longer piece in the batch
pads it further), and the pool mixes padding rows into the last token. So upstream gives a piece tokens that depend
on its batch. Here each clip gets the tokens upstream gives it when it tokenizes the clip alone (`clip_pieces`),
whatever batch it is in: `load_speech_tokenizer(folder).speech_tokens(clips)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from voxbackend.components.features.mel_features import WHISPER_HOP, WHISPER_RATE, whisper_log_mel
from voxbackend.models.checkpoint import read_config

SAMPLE_RATE = WHISPER_RATE
PIECE_SAMPLES = 30 * SAMPLE_RATE  # upstream's piece of a long clip
UPSTREAM_BATCH = 128  # pieces upstream featurizes (and pads) together
CONV_STRIDE = 2  # conv1's stride (1) times conv2's (2)
CHECKPOINT_PREFIX = "model.encoder."  # the released file holds a whole WhisperVQ model; some copies drop this
QUANTIZER_ROWS = 4096  # rows of codeword distances computed at a time (16384 floats each)


@dataclass(frozen=True)
class TokenizerConfig:
    """config.json's keys (WhisperVQConfig's names); the defaults are the released glm-4-voice-tokenizer's."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    encoder_layers: int = 32  # the checkpoint's; only the first quantize_position run
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    encoder_causal_convolution: bool = True
    encoder_causal_attention: bool = False
    quantize_causal_encoder: bool = False
    quantize_causal_block_size: int | None = 200
    pooling_kernel_size: int | None = 4
    pooling_type: str = "avg"
    pooling_position: int = 16
    quantize_position: int = 16
    quantize_vocab_size: int = 16384

    @classmethod
    def from_hf(cls, config: dict) -> "TokenizerConfig":
        cfg = cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config})
        if cfg.activation_function != "gelu" or cfg.pooling_type not in ("avg", "max"):
            raise ValueError(f"unsupported tokenizer config: activation {cfg.activation_function!r}, "
                             f"pooling {cfg.pooling_type!r}")
        if cfg.quantize_position < 1 or cfg.pooling_position > cfg.quantize_position:
            raise ValueError("the quantizer must follow at least one block and the pooling (upstream asserts it)")
        return cfg

    @property
    def pool(self) -> int:
        """Rows averaged into one token; upstream pools only when its position is a block's (>= 1)."""
        return self.pooling_kernel_size if self.pooling_kernel_size and self.pooling_position >= 1 else 1

    @property
    def token_samples(self) -> int:
        """Samples per token (1280 released): upstream's pad_to_multiple_of."""
        return CONV_STRIDE * self.pool * WHISPER_HOP

    @property
    def causal(self) -> bool:
        """Upstream's causal blocks pass no mask to SDPA (is_causal): plain causal, block and padding ignored."""
        return self.encoder_causal_attention or self.quantize_causal_encoder


def clip_pieces(audio: torch.Tensor, token_samples: int = 1280) -> list[tuple[torch.Tensor, int]]:
    """A clip's 30 s pieces, each with the length upstream zero-pads it to when it tokenizes the clip alone: the
    longest piece of its batch of 128, rounded up to a whole token (so a short last piece of a long clip is
    padded to 30 s)."""
    parts = [audio[i:i + PIECE_SAMPLES] for i in range(0, audio.shape[0], PIECE_SAMPLES)]
    out = []
    for g in range(0, len(parts), UPSTREAM_BATCH):
        group = parts[g:g + UPSTREAM_BATCH]
        padded = _round_up(max(p.shape[0] for p in group), token_samples)
        out += [(p, padded) for p in group]
    return out


def piece_features(piece: torch.Tensor, padded: int, n_mels: int = 128, token_samples: int = 1280) -> torch.Tensor:
    """[n_mels, frames]: WhisperFeatureExtractor's log-mel of the piece zero-padded to `padded` samples (the
    peak that floors it is the whole padded spectrogram's), cut after the frames the piece's tokens read (its own
    length rounded up to a token, and one frame more where upstream has one, for a centred convolution); the
    rest only reaches masked keys and dropped tokens."""
    piece = torch.as_tensor(piece, dtype=torch.float32)
    mel = whisper_log_mel(F.pad(piece, (0, padded - piece.shape[0])), n_mels)
    return mel[:, :min(padded, _round_up(piece.shape[0], token_samples) + WHISPER_HOP) // WHISPER_HOP]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_mask(valid: torch.Tensor, block: int | None, causal: bool) -> torch.Tensor:
    """[batch or 1, 1, rows, rows] bool, True where query row i may attend key row j: upstream's
    get_block_causal_attention_mask (j <= i or the same block of `block` rows, j not padding),
    get_extended_attention_mask when there is no block (j not padding), or plain causal for causal blocks."""
    rows = torch.arange(valid.shape[1], device=valid.device)
    earlier = rows[None, :] <= rows[:, None]
    if causal:
        return earlier[None, None]
    if block is None:
        allowed = torch.ones_like(earlier)
    else:
        allowed = earlier | (rows[None, :] // block == rows[:, None] // block)
    return allowed[None, None] & valid[:, None, None, :]


def nearest_codeword(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """[n, d], [vocab, d] -> [n]: upstream's vector_quantize, |c|^2 + |x|^2 - 2 x.c in one addmm (its rounding,
    so its pick among near-ties) and torch.min's index."""
    x, codebook = x.float(), codebook.float()
    codebook_sqr = torch.sum(codebook ** 2, dim=1)
    ids = []
    for rows in x.split(QUANTIZER_ROWS):
        distances = torch.addmm(codebook_sqr + torch.sum(rows ** 2, dim=1, keepdim=True), rows, codebook.t(),
                                alpha=-2.0, beta=1.0)
        ids.append(torch.min(distances, dim=1).indices)
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=x.device)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Whisper's pre-norm encoder layer (upstream's names)."""

    def __init__(self, cfg: TokenizerConfig):
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class SpeechTokenizer(nn.Module):
    """The encoder up to its quantizer; parameter names are the checkpoint's after `model.encoder.`."""

    def __init__(self, cfg: TokenizerConfig):
        super().__init__()
        self.cfg = cfg
        width, pad = cfg.d_model, 0 if cfg.encoder_causal_convolution else 1  # causal: padded in _conv
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, width, kernel_size=3, padding=pad)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=pad)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, width)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.quantize_position))
        self.codebook = nn.Embedding(cfg.quantize_vocab_size, width)

    def _conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.encoder_causal_convolution:
            x = F.pad(x, (2, 0))  # upstream's CausalConv1d: dilation * (kernel - 1) zeros on the left only
        return F.gelu(conv(x))

    def hidden(self, features: torch.Tensor, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [batch, n_mels, frames] (each piece's `piece_features`, zero-padded), samples [batch]: each
        piece's own length -> (the rows the quantizer reads [batch, tokens, width], which of them are tokens
        [batch, tokens]). A row counts when its first sample is the piece's, as upstream's attention mask says."""
        cfg = self.cfg
        x = self._conv(self.conv2, self._conv(self.conv1, features)).transpose(1, 2)
        x = x + self.embed_positions.weight[:x.shape[1]]
        step = CONV_STRIDE * WHISPER_HOP  # samples per row
        valid = torch.arange(x.shape[1], device=x.device)[None, :] * step < samples[:, None]
        mask = block_mask(valid, cfg.quantize_causal_block_size, cfg.causal)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask)
            if i + 1 == cfg.pooling_position and cfg.pool > 1:
                x = F.pad(x.transpose(1, 2), (0, -x.shape[1] % cfg.pool))  # upstream pads with zeros to a whole pool
                x = (F.avg_pool1d if cfg.pooling_type == "avg" else F.max_pool1d)(x, cfg.pool).transpose(1, 2)
                step *= cfg.pool
                valid = torch.arange(x.shape[1], device=x.device)[None, :] * step < samples[:, None]
                block = cfg.quantize_causal_block_size
                mask = block_mask(valid, None if block is None else block // cfg.pool, cfg.causal)
        return x, valid

    def forward(self, features: torch.Tensor, samples: torch.Tensor) -> list[torch.Tensor]:
        """-> each piece's token ids, math.ceil(samples / token_samples) of them."""
        rows, valid = self.hidden(features, samples)
        ids = nearest_codeword(rows[valid], self.codebook.weight)
        return list(ids.split(valid.sum(dim=1).tolist()))

    @torch.inference_mode()
    def speech_tokens(self, clips: Sequence[np.ndarray | torch.Tensor], max_batch: int = 32) -> list[list[int]]:
        """Mono float clips at 16 kHz -> each clip's ids, as upstream's extract_speech_token gives them to the
        clip alone (its 30 s pieces' ids one after the other), batched `max_batch` pieces at a time."""
        cfg, weight = self.cfg, self.codebook.weight
        pieces: list[tuple[int, int, torch.Tensor]] = []  # (clip, samples, features)
        for c, clip in enumerate(clips):
            audio = torch.as_tensor(np.asarray(clip, dtype=np.float32))
            if audio.ndim != 1:
                raise ValueError(f"clip {c}: expected mono samples [n], got shape {tuple(audio.shape)}")
            for piece, padded in clip_pieces(audio, cfg.token_samples):
                pieces.append((c, piece.shape[0], piece_features(piece, padded, cfg.num_mel_bins, cfg.token_samples)))
        tokens: list[list[int]] = [[] for _ in pieces]
        order = sorted(range(len(pieces)), key=lambda i: -pieces[i][2].shape[-1])  # similar lengths together
        for start in range(0, len(order), max_batch):
            chunk = order[start:start + max_batch]
            frames = pieces[chunk[0]][2].shape[-1]
            batch = torch.stack([F.pad(pieces[i][2], (0, frames - pieces[i][2].shape[-1])) for i in chunk])
            samples = torch.tensor([pieces[i][1] for i in chunk], device=weight.device)
            for i, ids in zip(chunk, self(batch.to(weight.device, weight.dtype), samples)):
                tokens[i] = ids.tolist()
        out: list[list[int]] = [[] for _ in clips]
        for (c, _, _), ids in zip(pieces, tokens):
            out[c].extend(ids)
        return out


def token_count(samples: int, token_samples: int = 1280) -> int:
    """Ids a clip of `samples` gets: ceil per 30 s piece (1280 samples a token divide 30 s evenly)."""
    return sum(math.ceil(min(PIECE_SAMPLES, samples - i) / token_samples) for i in range(0, samples, PIECE_SAMPLES))


def encoder_name(checkpoint_name: str, cfg: TokenizerConfig) -> str | None:
    """SpeechTokenizer's name for a checkpoint tensor (`model.encoder.` dropped where present), or None for what it
    does not run: what upstream's load_quantize_encoder drops (the final norm, the blocks from quantize_position
    on), the decoder, the positions added after the quantizer (embed_positions2) and the EMA buffers."""
    name = checkpoint_name.removeprefix(CHECKPOINT_PREFIX)
    if not name.startswith(("conv1.", "conv2.", "embed_positions.", "layers.", "codebook.")):
        return None
    if name.startswith("layers.") and int(name.split(".")[1]) >= cfg.quantize_position:
        return None
    return name


def load_speech_tokenizer(model_dir: str | Path, device: str = "cpu",
                          dtype: torch.dtype = torch.float32) -> SpeechTokenizer:
    """The official glm-4-voice-tokenizer folder: config.json and model*.safetensors (upstream's glob); only the
    tensors the tokenizer runs are read. Upstream runs float32; another dtype moves ids near ties."""
    model_dir = Path(model_dir)
    cfg = TokenizerConfig.from_hf(read_config(model_dir))
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for checkpoint_name in f.keys():
                name = encoder_name(checkpoint_name, cfg)
                if name is not None:
                    state[name] = f.get_tensor(checkpoint_name)
    model = SpeechTokenizer(cfg)
    model.load_state_dict(state, strict=True)
    return model.to(device, dtype).eval()
