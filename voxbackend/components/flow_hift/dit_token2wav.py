"""Step-Audio 2's streaming speech decoder (its token2wav `Token2wav.set_stream_cache` + `stream`): speech tokens ->
DiT flow (dit_flow.py, 50 Hz mel) -> HiFT (hift.py, 24 kHz audio), chunk by chunk, one utterance per state.

An utterance starts from a `VoicePrompt` (the prompt's speech tokens, their mel and a speaker vector): the prompt
runs through the flow as a chunk of its own, its first `lookahead_tokens` tokens again as its lookahead (as the
reference does), and fills the encoder and DiT caches. Every later chunk is `chunk_tokens` new tokens plus the
`lookahead_tokens` tokens that open the next chunk (passed again there); the last chunk is all remaining tokens,
without lookahead. With the reference's 25 + 3 tokens a chunk gives 50 mel frames, 1 s of audio.

HiFT (the reference's `hift_cache_dict`): each chunk's mel is vocoded after the previous chunk's last
`mel_cache_frames` mel frames, with those frames' excitation written over the start of the new excitation (the
sine phase continues); the re-vocoded overlap is cross-faded (Hamming) with the audio it replaces. The newest
overlap's audio is held back until the next chunk, or returned by the last chunk. The reference quantises to int16
after this; `decode_chunk` returns the float samples before that.

The DiT's attention cache is trimmed as the reference trims it (`Token2wav.stream`: once it holds more than
prompt frames + 100, keep `[:prompt_frames]` and `[-100:]`). The evident intent is "the prompt and the newest 100
frames", but the reference's DiT *prepends* each chunk's keys (`cat([k_new, k_cache])`; ours appends), so its cache
is ordered [newest chunk, ..., first chunk, prompt] (frames in time order within each) and the trim keeps the
first `prompt_frames` of that, the newest generated frames (and the prompt's start while fewer have been
generated), and the last 100, the prompt's last 100 frames (for a shorter prompt, the prompt and the oldest kept
generated frames). Attention is unmasked and has no positions, so only *which* frames are kept matters: we follow
the reference's order in `key_order` and keep the same frames. Its flow noise is read at the cache's length
(`rand_noise[offset:]`, offset = the cached frames), so after a trim every chunk reads the noise from there too; we
do the same (`DiTFlowStream.frames`, which only indexes the noise, is set to the trimmed length). Outputs differ
from the intent's from the first chunk after a trim on (the 4th with 25-token chunks);
tests/test_step_audio2_token2wav.py compares with the reference over 5 chunks, two of them after trims. The
cache and the noise a stream reads stay bounded by prompt frames + 100 + one chunk.

Per-utterance state (`DiTToken2WavState`) is tensors and dataclasses: the `DiTFlowStream` (its caches; it also
refers to the shared flow module), the HiFT cache (token2wav.py's `HiFTCache`) and the HiFT noise generator's state
(a uint8 tensor). The HiFT draws its excitation noise from that generator, as the reference draws from torch's
global generator: seeded alike, the draws are the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from voxbackend.components.flow_hift.dit_estimator import BlockCache
from voxbackend.components.flow_hift.dit_flow import DiTFlow, DiTFlowStream
from voxbackend.components.flow_hift.hift import HiFTGenerator
from voxbackend.components.flow_hift.token2wav import HiFTCache


@dataclass(frozen=True)
class DiTToken2WavConfig:
    chunk_tokens: int = 25          # new tokens per chunk (50 mel frames, 1 s); `split_chunks` cuts by it
    lookahead_tokens: int = 3       # = the flow encoder's pre_lookahead_len
    mel_cache_frames: int = 8       # HiFT overlap (160 ms); its excitation/audio: mel_cache_frames x 480 samples
    keep_recent_frames: int = 100   # the attention-cache trim (see the module docstring)
    max_chunk_tokens: int = 64      # a noise buffer drawn from a generator covers chunks up to this long


@dataclass
class VoicePrompt:
    tokens: torch.Tensor        # (P,) long, the prompt's speech tokens, P >= lookahead_tokens
    mel: torch.Tensor           # (2P, mel_bins) the prompt audio's 24 kHz mel, padded to 2 frames per token
    embedding: torch.Tensor     # (spk_embed_dim,) speaker vector


@dataclass
class DiTToken2WavState:
    """One utterance's decoder state."""
    flow: DiTFlowStream             # encoder + DiT caches, noise
    prompt_frames: int              # 2P: the trim keeps this many frames from the reference's cache start
    key_order: torch.Tensor         # (cached frames,) long: the reference's cache order as indices into ours
    hift_rng: torch.Tensor          # uint8: the HiFT noise generator's state
    hift_cache: HiFTCache | None = None
    done: bool = False              # the last chunk has been decoded


def cross_fade(speech: torch.Tensor, previous: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """speech: (samples,); previous: (>= n,) the audio speech's first n samples replace; window: (2n,) rising
    then falling (float64, as the reference's numpy window). Returns speech with its first n samples faded in
    over previous's last n."""
    n = window.numel() // 2
    window = window.to(speech.device)
    faded = speech[:n] * window[:n] + previous[-n:] * window[n:]
    return torch.cat([faded.to(speech.dtype), speech[n:]])


def split_chunks(n_tokens: int, cfg: DiTToken2WavConfig) -> list[tuple[int, int, bool]]:
    """How a complete sequence of n_tokens is cut: (start, end, last) per chunk, chunk_tokens new tokens plus
    lookahead_tokens of lookahead each, while more than that remain; then the rest as the last chunk."""
    chunks, start, window = [], 0, cfg.chunk_tokens + cfg.lookahead_tokens
    while n_tokens - start > window:
        chunks.append((start, start + window, False))
        start += cfg.chunk_tokens
    chunks.append((start, n_tokens, True))
    return chunks


class DiTToken2Wav:
    def __init__(self, cfg: DiTToken2WavConfig, flow: DiTFlow, hift: HiFTGenerator):
        encoder = flow.cfg.encoder
        if cfg.lookahead_tokens != encoder.pre_lookahead_len:
            raise ValueError(f"lookahead_tokens must be the flow's pre_lookahead_len ({encoder.pre_lookahead_len})")
        if cfg.chunk_tokens * encoder.upsample < cfg.mel_cache_frames:
            raise ValueError("a chunk must cover the HiFT cache")
        self.cfg, self.flow, self.hift = cfg, flow, hift
        self.source_cache_samples = cfg.mel_cache_frames * hift.cfg.samples_per_frame
        self.speech_window = torch.from_numpy(np.hamming(2 * self.source_cache_samples))

    @property
    def sample_rate(self) -> int:
        return self.hift.cfg.sampling_rate

    def noise_frames(self, prompt: VoicePrompt) -> int:
        """Frames of flow noise an utterance reads at most (the trim bounds it), with chunks up to
        max_chunk_tokens tokens: what `start` draws from a generator."""
        cfg, upsample = self.cfg, self.flow.cfg.encoder.upsample
        return upsample * len(prompt.tokens) + cfg.keep_recent_frames + upsample * cfg.max_chunk_tokens

    @torch.inference_mode()
    def start(self, prompt: VoicePrompt, noise: torch.Tensor | torch.Generator,
              hift_seed: int | torch.Generator = 0) -> DiTToken2WavState:
        """noise: (mel_bins, frames) flow noise indexed by the DiT cache's length (the frame, prompt included,
        until the first trim), e.g. the reference's `rand_noise[0]`; or a generator to draw noise_frames(prompt)
        frames from. hift_seed: seeds the HiFT's excitation noise (a generator: its current state is copied)."""
        flow_cfg, lookahead = self.flow.cfg, self.cfg.lookahead_tokens
        tokens = torch.as_tensor(prompt.tokens, dtype=torch.long).flatten()
        mel = torch.as_tensor(prompt.mel)
        if tokens.numel() < lookahead:
            raise ValueError(f"the prompt needs at least {lookahead} tokens")
        if mel.shape != (flow_cfg.encoder.upsample * tokens.numel(), flow_cfg.mel_bins):
            raise ValueError(f"prompt mel must be ({flow_cfg.encoder.upsample} x tokens, {flow_cfg.mel_bins}), "
                             f"not {tuple(mel.shape)}")
        if isinstance(noise, torch.Generator):
            noise = torch.randn(flow_cfg.mel_bins, self.noise_frames(prompt), generator=noise, device=noise.device)
        if isinstance(hift_seed, torch.Generator):
            rng = hift_seed.get_state()
        else:
            rng = torch.Generator().manual_seed(hift_seed).get_state()
        stream = DiTFlowStream(self.flow, torch.cat([tokens, tokens[:lookahead]]), mel, prompt.embedding, noise)
        return DiTToken2WavState(stream, mel.size(0), torch.arange(mel.size(0)), rng)

    @torch.inference_mode()
    def decode_chunk(self, state: DiTToken2WavState, tokens, last_chunk: bool = False) -> torch.Tensor:
        """tokens: (N,) the chunk's tokens, followed by lookahead_tokens lookahead tokens unless last_chunk.
        Returns the chunk's audio (samples,), float32 on the codec's device: 480 samples per new mel frame (2 per
        token), the held-back HiFT overlap moving from one chunk to the next; the last chunk returns the overlap
        too."""
        if state.done:
            raise RuntimeError("the utterance's last chunk has been decoded")
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        upsample = self.flow.cfg.encoder.upsample
        if not last_chunk and (tokens.numel() - self.cfg.lookahead_tokens) * upsample < self.cfg.mel_cache_frames:
            raise ValueError("a chunk before the last must cover the HiFT cache after its lookahead")
        if last_chunk and tokens.numel() == 0:
            raise ValueError("the last chunk has no tokens")
        mel = state.flow(tokens, last_chunk=last_chunk)
        self._trim_attention_cache(state)
        audio = self._vocode(state, mel, last_chunk)
        state.done = last_chunk
        return audio

    def _trim_attention_cache(self, state: DiTToken2WavState) -> None:
        stream, keep = state.flow, self.cfg.keep_recent_frames
        cached = stream.step_caches[0][0].keys.size(2)
        old = state.key_order.numel()
        # the reference puts each chunk's frames before the cached ones
        order = torch.cat([torch.arange(old, cached), state.key_order])
        if cached > state.prompt_frames + keep:
            kept = torch.cat([order[:state.prompt_frames], order[-keep:]])
            index = kept.to(stream.step_caches[0][0].keys.device)
            stream.step_caches = [[BlockCache(c.keys.index_select(2, index), c.values.index_select(2, index),
                                              c.conv_tails) for c in step] for step in stream.step_caches]
            order = torch.arange(kept.numel())
            stream.frames = kept.numel()    # the next chunk's noise is read at the cache's length, as upstream
        state.key_order = order

    def _vocode(self, state: DiTToken2WavState, mel: torch.Tensor, last_chunk: bool) -> torch.Tensor:
        cache, device = state.hift_cache, self.hift.conv_pre.weight.device
        mel = mel.to(device, torch.float32)
        if cache is not None:
            mel = torch.cat([cache.mel, mel], dim=1)
        generator = torch.Generator()
        generator.set_state(state.hift_rng)
        speech, source = self.hift(mel[None], [generator], [cache.source if cache is not None else None])
        state.hift_rng = generator.get_state()
        speech, source = speech[0].float(), source[0].float()
        n = self.source_cache_samples
        if cache is not None:
            speech = cross_fade(speech, cache.speech, self.speech_window)
        if last_chunk:
            state.hift_cache = None
            return speech
        state.hift_cache = HiFTCache(mel[:, -self.cfg.mel_cache_frames:].clone(), source[:, -n:].clone(),
                                     speech[-n:].clone())
        return speech[:-n]
