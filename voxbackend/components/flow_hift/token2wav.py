"""Streaming speech-token detokenizer: tokens -> flow matching -> mel -> HiFT -> 24 kHz audio, for the
CosyVoice2 decoder family (Chatterbox's S3Gen has the same flow and HiFT; Step-Audio-2 the same HiFT with a DiT
estimator). `Token2Wav` needs of its flow only `flow(rows: list[FlowRow]) -> list[mel]` and a `cfg` with
`token_mel_ratio`, `pre_lookahead_len`, `mel_bins` and `spk_embed_dim`.

Each request owns a `DecodeStream` (its prompt, speaker, tokens so far, emitted offset, HiFT cache and noise
generator); `Token2Wav.decode` takes one window from each of several streams and runs them as one flow batch (the
guidance pair included) and as few HiFT batches as their lengths allow. The schedule is the reference's
(CosyVoice2Model.tts, stream=True):

- a window is due when `hop + pre_lookahead_len` tokens past the emitted offset are in; the flow re-encodes the
  prompt and *all* tokens so far (chunk-causal attention; the last `pre_lookahead_len` tokens only as lookahead)
  and the window's new mel is the `hop` tokens after the offset. Re-encoding from the start keeps every window
  exactly what the reference computes; its cost grows with the utterance (the price of exactness, bounded by the
  noise buffer's 300 s).
- the first window's hop is `hop + pad`, `pad` rounding prompt + first window up to a multiple of `hop`, so that
  windows end on attention-chunk boundaries.
- HiFT keeps, per request, the last `mel_cache_frames` mel frames, their excitation and their audio: the next
  window re-vocodes those frames (excitation phase continued from the cache) and cross-fades the overlap
  with a Hamming window, so window boundaries do not click.
- the last window (input ended, fewer than hop + lookahead tokens left) takes all remaining tokens with no
  lookahead and full attention, and flushes the HiFT cache.

First window size (`StreamConfig.first_hop_tokens`, or per stream in `new_stream`): the first audio needs
`first_hop + pre_lookahead_len` tokens from the LM, so a smaller first window gives earlier first audio (at 25
tokens/s of LM output roughly 40 ms per token saved, plus a smaller first flow call). The cost is quality at its
edge: a window that ends inside an attention chunk emits frames that saw only part of their chunk (the offline
model would have seen all of it), and a first window shorter than the HiFT cache overlap gives the cross-fade
little to work with. The default (the reference's) ends the first window on a chunk boundary.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import numpy as np
import torch

from voxbackend.components.flow_hift.flow_encoder import EncoderConfig
from voxbackend.components.flow_hift.flow_estimator import EstimatorConfig
from voxbackend.components.flow_hift.flow_matching import FlowConfig, FlowMatching, FlowRow
from voxbackend.components.flow_hift.hift import HiFTConfig, HiFTGenerator, fold_weight_norm
from voxbackend.errors import InvalidRequest
from voxbackend.ints import to_host


@dataclass(frozen=True)
class StreamConfig:
    hop_tokens: int = 25                    # tokens per window after the first (= the flow's attention chunk)
    first_hop_tokens: int | None = None     # None: hop + pad to the next chunk boundary (the reference)
    mel_cache_frames: int = 8               # HiFT overlap re-vocoded and cross-faded per window


@dataclass(frozen=True)
class Token2WavConfig:
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)

    CONFIG_NAME = "token2wav.json"

    @classmethod
    def from_dict(cls, data: dict) -> "Token2WavConfig":
        return _build(cls, data)

    def to_dict(self) -> dict:
        return _as_dict(self)


def _build(kind, data: dict):
    kwargs = {}
    for f in fields(kind):
        if f.name not in data:
            continue
        value = data[f.name]
        sub = {"encoder": EncoderConfig, "estimator": EstimatorConfig, "flow": FlowConfig, "hift": HiFTConfig,
               "stream": StreamConfig}.get(f.name)
        if sub is not None:
            value = _build(sub, value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kwargs[f.name] = value
    unknown = set(data) - {f.name for f in fields(kind)}
    if unknown:
        raise ValueError(f"unknown {kind.__name__} keys: {sorted(unknown)}")
    return kind(**kwargs)


def _as_dict(obj) -> dict:
    return {f.name: _as_dict(getattr(obj, f.name)) if is_dataclass(getattr(obj, f.name)) else getattr(obj, f.name)
            for f in fields(obj)}


@dataclass
class HiFTCache:
    mel: torch.Tensor       # (mel_bins, mel_cache_frames)
    source: torch.Tensor    # (1, mel_cache_frames * samples_per_frame)
    speech: torch.Tensor    # (mel_cache_frames * samples_per_frame,)


@dataclass
class DecodeStream:
    """One request's detokenizer state."""
    prompt_tokens: torch.Tensor     # (P,) long
    prompt_feat: torch.Tensor       # (2P, mel_bins)
    embedding: torch.Tensor         # (spk_embed_dim,)
    generator: torch.Generator      # HiFT excitation noise, drawn window by window
    first_hop: int
    offline: bool = False           # decode everything as one window once the input ends
    # windows cut as the reference cuts a complete token sequence (tts with all tokens in), whatever the arrival
    # timing: after a padded first window the next one waits until the flush decision is known (Token2Wav.window_due)
    as_complete: bool = False
    tokens: list[int] = field(default_factory=list)
    token_offset: int = 0           # tokens whose audio has been emitted
    ended: bool = False             # no more tokens will come
    flush_next: bool = False        # the next window is the final one (see Token2Wav.decode)
    done: bool = False              # the final window has been emitted
    hift_cache: HiFTCache | None = None

    def push(self, tokens) -> None:
        if self.ended:
            raise RuntimeError("push after end")
        self.tokens.extend(int(t) for t in tokens)

    def end(self) -> None:
        self.ended = True


class Token2Wav:
    def __init__(self, cfg: Token2WavConfig, flow: FlowMatching, hift: HiFTGenerator):
        """`cfg.stream` and `cfg.hift` apply; the flow brings its own `cfg` (any FlowRow -> mel module)."""
        if cfg.stream.hop_tokens * flow.cfg.token_mel_ratio < cfg.stream.mel_cache_frames:
            raise ValueError("hop_tokens must cover the HiFT cache")
        self.cfg, self.flow, self.hift = cfg, flow, hift
        overlap = cfg.stream.mel_cache_frames * cfg.hift.samples_per_frame
        self.speech_window = torch.from_numpy(np.hamming(2 * overlap))      # float64, as the reference's numpy window

    @property
    def sample_rate(self) -> int:
        return self.cfg.hift.sampling_rate

    # ---- streams -------------------------------------------------------------------------------------------
    def new_stream(self, prompt_tokens, prompt_feat: torch.Tensor, embedding: torch.Tensor, seed: int = 0,
                   first_hop_tokens: int | None = None, offline: bool = False,
                   as_complete: bool = False) -> DecodeStream:
        cfg, flow = self.cfg, self.flow
        prompt_tokens = torch.as_tensor(prompt_tokens, dtype=torch.long).flatten()
        prompt_feat = torch.as_tensor(prompt_feat, dtype=torch.float32)
        if prompt_feat.ndim != 2 or prompt_feat.size(1) != flow.cfg.mel_bins:
            raise InvalidRequest(f"prompt_feat must be (frames, {flow.cfg.mel_bins})", field="prompt_feat")
        if prompt_feat.size(0) != flow.cfg.token_mel_ratio * prompt_tokens.numel():
            raise InvalidRequest(f"prompt_feat has {prompt_feat.size(0)} frames, expected "
                                 f"{flow.cfg.token_mel_ratio} per prompt token", field="prompt_feat")
        embedding = torch.as_tensor(embedding, dtype=torch.float32).flatten()
        if embedding.numel() != flow.cfg.spk_embed_dim:
            raise InvalidRequest(f"speaker embedding must have {flow.cfg.spk_embed_dim} values", field="embedding")
        hop = cfg.stream.hop_tokens
        if first_hop_tokens is None:
            first_hop_tokens = cfg.stream.first_hop_tokens
        if first_hop_tokens is None:
            first_hop_tokens = hop + math.ceil(prompt_tokens.numel() / hop) * hop - prompt_tokens.numel()
        if first_hop_tokens * flow.cfg.token_mel_ratio < cfg.stream.mel_cache_frames:
            raise InvalidRequest("first window is shorter than the HiFT overlap", field="first_hop_tokens")
        return DecodeStream(prompt_tokens, prompt_feat, embedding, torch.Generator().manual_seed(seed),
                            first_hop_tokens, offline, as_complete)

    def hop(self, stream: DecodeStream) -> int:
        return stream.first_hop if stream.token_offset == 0 else self.cfg.stream.hop_tokens

    def window_due(self, stream: DecodeStream) -> str | None:
        """'window', 'final' or None (waiting for tokens)."""
        if stream.done:
            return None
        if stream.flush_next:
            return "final"
        lookahead = self.flow.cfg.pre_lookahead_len
        pending = len(stream.tokens) - stream.token_offset
        if stream.as_complete and not stream.offline:
            # A complete sequence flushes right after a window of hop h when fewer than h + lookahead tokens are
            # left: until the input ends, wait for as many (after a padded first window, more than a plain hop).
            last_hop = 0 if stream.token_offset == 0 else stream.first_hop if stream.token_offset == stream.first_hop \
                else self.cfg.stream.hop_tokens
            if stream.ended:
                return "final" if 0 < stream.token_offset and pending < last_hop + lookahead \
                    or pending < self.hop(stream) + lookahead else "window"
            return "window" if pending >= max(self.hop(stream), last_hop) + lookahead else None
        if not stream.offline and pending >= self.hop(stream) + lookahead:
            return "window"
        return "final" if stream.ended else None

    # ---- decoding ------------------------------------------------------------------------------------------
    def decode(self, streams: list[DecodeStream]) -> list[torch.Tensor]:
        """One due window per stream, batched; returns each window's audio (samples,) on the CPU."""
        kinds = [self.window_due(s) for s in streams]
        if None in kinds:
            raise ValueError("decode() got a stream with no window due")
        ratio, lookahead = self.flow.cfg.token_mel_ratio, self.flow.cfg.pre_lookahead_len
        rows, flow_of = [], {}
        for i, (s, kind) in enumerate(zip(streams, kinds)):
            end = s.token_offset + self.hop(s) + lookahead if kind == "window" else len(s.tokens)
            if end == 0:
                continue        # a request that produced no tokens has no audio
            tokens = torch.cat([s.prompt_tokens, torch.tensor(s.tokens[:end], dtype=torch.long)])
            flow_of[i] = len(rows)
            rows.append(FlowRow(tokens, s.prompt_feat, s.embedding, finalize=kind == "final",
                                streaming=kind == "window"))
        mels = to_host(self.flow(rows)) if rows else []  # the mel caches and cross-fades live on the host
        new_mel = [mels[flow_of[i]][:, s.token_offset * ratio:] if i in flow_of else None
                   for i, s in enumerate(streams)]
        audio = self._vocode(streams, kinds, new_mel)
        for s, kind in zip(streams, kinds):
            if kind == "window":
                hop = self.hop(s)
                s.token_offset += hop
                # the reference decides on the flush right after a window, against the hop it just used: if the
                # input has ended and fewer than that hop + lookahead tokens are left, they all go in the final window
                # (after a padded first window this can flush tokens a plain hop would still have windowed)
                s.flush_next = s.ended and len(s.tokens) - s.token_offset < hop + lookahead
            else:
                s.token_offset, s.done = len(s.tokens), True
        return audio

    def _vocode(self, streams, kinds, new_mel) -> list[torch.Tensor]:
        out = [torch.zeros(0)] * len(streams)
        mel_in = {}
        for i, (s, mel) in enumerate(zip(streams, new_mel)):
            if mel is None:
                if s.hift_cache is not None:
                    mel = torch.zeros(self.flow.cfg.mel_bins, 0)
                else:
                    continue
            mel_in[i] = torch.cat([s.hift_cache.mel, mel], dim=1) if s.hift_cache is not None else mel
        groups: dict[int, list[int]] = {}
        for i, mel in mel_in.items():
            groups.setdefault(mel.size(1), []).append(i)
        device = next(self.hift.parameters()).device
        rows, speeches, sources = [], [], []
        for members in groups.values():
            mel = torch.stack([mel_in[i] for i in members]).to(device, torch.float32)  # HiFT casts what it needs
            caches = [streams[i].hift_cache for i in members]
            speech, source = self.hift(mel, [streams[i].generator for i in members],
                                       [c.source if c is not None else None for c in caches])
            rows += members
            speeches += list(speech)
            sources += list(source)
        host = to_host(speeches + sources)  # every group's speech and excitation in one copy
        for row, i in enumerate(rows):
            out[i] = self._emit(streams[i], kinds[i], mel_in[i], host[row], host[len(rows) + row])
        return out

    def _emit(self, s: DecodeStream, kind: str, mel: torch.Tensor, speech: torch.Tensor,
              source: torch.Tensor) -> torch.Tensor:
        overlap = self.cfg.stream.mel_cache_frames * self.cfg.hift.samples_per_frame
        if s.hift_cache is not None:
            n = overlap
            faded = speech[:n] * self.speech_window[:n] + s.hift_cache.speech[-n:] * self.speech_window[n:]
            speech = torch.cat([faded.to(speech.dtype), speech[n:]])
        if kind == "final":
            s.hift_cache = None
            return speech
        s.hift_cache = HiFTCache(mel[:, -self.cfg.stream.mel_cache_frames:], source[:, -overlap:], speech[-overlap:])
        return speech[:-overlap]

    def decode_utterance(self, prompt_tokens, prompt_feat, embedding, tokens, seed: int = 0) -> torch.Tensor:
        """Whole-utterance (non-streaming) decode: one final window over all tokens."""
        stream = self.new_stream(prompt_tokens, prompt_feat, embedding, seed=seed, offline=True)
        stream.push(tokens)
        stream.end()
        return self.decode([stream])[0]


def load_token2wav(folder: str | Path, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> Token2Wav:
    """Loads `flow.pt` + `hift.pt` (the official CosyVoice2 state dicts) or `flow.safetensors` + `hift.safetensors`
    (the same names), with an optional `token2wav.json` overriding Token2WavConfig's defaults (CosyVoice2-0.5B's)."""
    folder = Path(folder)
    config_path = folder / Token2WavConfig.CONFIG_NAME
    cfg = Token2WavConfig.from_dict(json.loads(config_path.read_text())) if config_path.exists() else Token2WavConfig()

    def state(name: str) -> dict[str, torch.Tensor]:
        if (folder / f"{name}.safetensors").exists():
            from safetensors.torch import load_file
            return load_file(str(folder / f"{name}.safetensors"))
        return torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)

    flow = FlowMatching(cfg.flow)
    flow.load_state_dict(state("flow"), strict=True)
    hift = HiFTGenerator(cfg.hift)
    hift.load_state_dict(fold_weight_norm(state("hift"), cfg.hift), strict=True)
    return Token2Wav(cfg, flow.to(device, dtype).eval(), hift.to(device, dtype).eval())
