"""GLM-4-Voice's speech decoder (the `glm-4-voice-decoder` folder: config.yaml, flow.pt, hift.pt): audio token ids
(12.5 a second) -> 22.05 kHz speech, block by block as GLM-4-Voice's server streams a reply, batched across
requests. The flow is CosyVoice 1's (voxbackend.components.flow_hift.xvec_flow), the vocoder CosyVoice 1's HiFT.

Upstream's procedure (THUDM/GLM-4-Voice web_demo.py `inference_fn`, flow_inference.py `AudioDecoder.token2wav`):
- Blocks of 25, 50, 100, 150, then 200 tokens (`block_size_list`: the first small, so the first audio comes
  early). A full block is cut when the LM's next token arrives, and the block open when the reply ends is the last
  (`finalize`). A codec sees no text tokens, so here a full block waits for the next audio token or the end: the
  same blocks, except that upstream, when text tokens alone follow the last full block, never finalizes and drops
  the audio it held back.
- The flow decodes a block with every earlier token as its prompt tokens, what the earlier blocks returned
  (concatenated) as its prompt mel, and a zero x-vector.
- A non-final block holds its last `mel_overlap` (34) mel frames back; the next block's first frames are
  cross-faded into them (a Hamming window).
- HiFT cache: a non-final block's audio stops `mel_cache_frames` (1) mel frame before its end; the next block
  vocodes that frame again, before its own, with the cached excitation (the sine phase runs on), no cross-fade.
- What a block returns, and the later ones take as prompt mel, is the mel it vocoded, the HiFT cache frame in
  front included: block k (counting from 1, k >= 2) is prompted with k - 2 frames more than its prompt tokens
  stand for, so its mel starts that much later in the token timeline. Kept: it is how upstream serves the model.
- Noise: upstream reseeds torch with 42 at every flow call and draws the flow's noise, then HiFT's excitation
  noise, from it (on a GPU, the flow's from the device's generator: other numbers, the same distribution). Here
  each block draws them, in that order, from a CPU generator seeded with its request's seed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import numpy as np
import torch

from voxbackend.components.flow_hift.hift import HiFTConfig, HiFTGenerator, fold_weight_norm
from voxbackend.components.flow_hift.xvec_flow import XvecFlow, XvecFlowConfig, XvecFlowRow
from voxbackend.ints import to_host

# config.yaml's hift: CosyVoice 1's 22.05 kHz HiFT (its excitation phase summed per sample)
GLM4_VOICE_HIFT = HiFTConfig(sampling_rate=22050, upsample_rates=(8, 8), upsample_kernel_sizes=(16, 16),
                             source_resblock_kernel_sizes=(7, 11),
                             source_resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)), phase_rate="sample")


@dataclass(frozen=True)
class CodecConfig:
    """The released decoder's values by default; a folder's `codec.json` overrides some (a tiny test decoder's
    sizes: the released folder has none, its config.yaml is hyperpyyaml, which the server does not parse)."""
    flow: XvecFlowConfig = field(default_factory=XvecFlowConfig)
    hift: HiFTConfig = GLM4_VOICE_HIFT
    block_sizes: tuple[int, ...] = (25, 50, 100, 150, 200)     # the last repeats
    token_overlap: int = 5          # tokens' worth of mel held back and cross-faded per block
    mel_cache_frames: int = 1       # mel frames re-vocoded at the next block
    noise_seed: int = 42

    CONFIG_NAME = "codec.json"

    @property
    def mel_overlap(self) -> int:
        # upstream's int(token_overlap_len / input_frame_rate * 22050 / 256), in Python floats
        return int(self.token_overlap / self.flow.token_rate * self.flow.sample_rate / self.flow.hop)

    @property
    def sample_rate(self) -> int:
        return self.hift.sampling_rate

    @property
    def first_block(self) -> int:
        return self.block_sizes[0]

    @classmethod
    def from_dict(cls, data: dict) -> "CodecConfig":
        return _override(cls(), data)

    def to_dict(self) -> dict:
        return asdict(self)


def _override(base, data: dict):
    """base (a dataclass) with data's values, nested dataclasses overridden field by field."""
    unknown = set(data) - {f.name for f in fields(base)}
    if unknown:
        raise ValueError(f"unknown {type(base).__name__} keys: {sorted(unknown)}")
    values = {}
    for name, value in data.items():
        current = getattr(base, name)
        if is_dataclass(current):
            value = _override(current, value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        values[name] = value
    return replace(base, **values)


def decoder_config(folder: str | Path) -> CodecConfig:
    path = Path(folder) / CodecConfig.CONFIG_NAME
    return CodecConfig.from_dict(json.loads(path.read_text())) if path.is_file() else CodecConfig()


@dataclass
class HiFTCache:
    mel: torch.Tensor       # (mel_bins, mel_cache_frames)
    source: torch.Tensor    # (1, mel_cache_frames * samples_per_frame) excitation


@dataclass(frozen=True)
class Block:
    """tokens[start:end] of a request, the final block or not."""
    start: int
    end: int
    final: bool


@dataclass
class DecodeState:
    """One request's decoder state."""
    seed: int                       # every block's noise generator starts from it
    embedding: torch.Tensor         # (spk_embed_dim,) x-vector (upstream: zeros)
    prompt_feat: torch.Tensor       # (frames, mel_bins): what the decoded blocks returned, the next prompt mel
    tokens: list[int] = field(default_factory=list)
    offset: int = 0                 # tokens decoded: the next block's prompt tokens
    blocks: int = 0                 # blocks decoded
    ended: bool = False             # no more tokens will come
    done: bool = False              # the final block has been decoded
    mel_overlap: torch.Tensor | None = None     # (mel_bins, mel_overlap) held back for the cross-fade
    hift_cache: HiFTCache | None = None

    def push(self, tokens) -> None:
        if self.ended:
            raise RuntimeError("push after end")
        self.tokens.extend(int(t) for t in tokens)

    def end(self) -> None:
        self.ended = True


class Glm4VoiceCodec:
    def __init__(self, cfg: CodecConfig, flow: XvecFlow, hift: HiFTGenerator):
        """`cfg.flow` is the flow's own config."""
        self.cfg, self.flow, self.hift = cfg, flow, hift
        if cfg.flow.frames([min(cfg.block_sizes)])[0] < cfg.mel_overlap + cfg.mel_cache_frames:
            raise ValueError("every block must cover the mel overlap and the HiFT cache")
        # float64, as upstream's numpy window (the fade is computed in float64, then stored as float32)
        self.window = torch.from_numpy(np.hamming(2 * cfg.mel_overlap))

    @property
    def sample_rate(self) -> int:
        return self.cfg.hift.sampling_rate

    def new_state(self, seed: int | None = None, embedding: torch.Tensor | None = None) -> DecodeState:
        flow = self.cfg.flow
        embedding = torch.zeros(flow.spk_embed_dim) if embedding is None else embedding.float().flatten()
        return DecodeState(self.cfg.noise_seed if seed is None else seed, embedding, torch.zeros(0, flow.mel_bins))

    def next_block(self, state: DecodeState) -> Block | None:
        """The block due now, or None (waiting for tokens)."""
        if state.done:
            return None
        sizes = self.cfg.block_sizes
        size = sizes[min(state.blocks, len(sizes) - 1)]
        pending = len(state.tokens) - state.offset
        if pending > size:
            return Block(state.offset, state.offset + size, final=False)
        return Block(state.offset, len(state.tokens), final=True) if state.ended else None

    def decode(self, states: list[DecodeState], blocks: list[Block]) -> list[torch.Tensor]:
        """One block per request, batched; returns each block's audio (samples,), float32 on the CPU. A block must
        continue its request (next_block gives upstream's); only a request without tokens has an empty one, final,
        which gives no audio."""
        rows, flow_of = [], {}
        for i, (s, b) in enumerate(zip(states, blocks)):
            if s.done or b.start != s.offset or not b.start <= b.end <= len(s.tokens):
                raise ValueError(f"block {b} does not continue request {i}")
            if b.end == b.start:
                if b.start or not b.final:
                    raise ValueError(f"empty block {b}")
                continue
            flow_of[i] = len(rows)
            rows.append(XvecFlowRow(torch.tensor(s.tokens[:b.end]), self._prompt_mel(s, b), s.embedding,
                                    torch.Generator().manual_seed(s.seed)))
        mels = to_host(self.flow(rows)) if rows else []     # the overlaps and caches live on the host
        vocode = {i: self._hold_back(states[i], blocks[i], mels[row]) for i, row in flow_of.items()}
        speech, source = self._vocode(vocode, {i: rows[row].generator for i, row in flow_of.items()}, states)
        audio = []
        for i, (s, b) in enumerate(zip(states, blocks)):
            audio.append(self._emit(s, b, vocode[i], speech[i], source[i]) if i in vocode else torch.zeros(0))
            s.offset, s.blocks, s.done = b.end, s.blocks + 1, b.final
        return audio

    def _prompt_mel(self, s: DecodeState, b: Block) -> torch.Tensor:
        # The prompt mel outgrows the prompt tokens by a frame a block (see above); after ~36 blocks (9 minutes of
        # speech) it would reach the new tokens' frames, where upstream fails: never let it cover them.
        limit = self.cfg.flow.frames([b.start])[0]
        prompt = s.prompt_feat[:limit]
        frames = self.cfg.flow.frames([b.end])[0] - prompt.size(0)
        if s.hift_cache is not None:
            frames += self.cfg.mel_cache_frames
        if not b.final and frames < self.cfg.mel_overlap + self.cfg.mel_cache_frames:
            raise ValueError(f"block {b} is too short for the mel overlap and the HiFT cache")
        return prompt

    def _hold_back(self, s: DecodeState, b: Block, mel: torch.Tensor) -> torch.Tensor:
        """The block's mel to vocode: its start cross-faded into the last block's held-back frames, the HiFT cache
        frames in front; a non-final block holds its last mel_overlap frames back."""
        if s.mel_overlap is not None:
            # a block shorter than the overlap (only a final one, after many blocks) fades what it has
            n, ov = min(self.cfg.mel_overlap, mel.size(1)), self.cfg.mel_overlap
            faded = mel[:, :n] * self.window[:n] + s.mel_overlap[:, :n] * self.window[ov:ov + n]
            mel = torch.cat([faded.float(), mel[:, n:]], dim=1)
        if s.hift_cache is not None:
            mel = torch.cat([s.hift_cache.mel, mel], dim=1)
        if b.final:
            s.mel_overlap = None
            return mel
        s.mel_overlap = mel[:, -self.cfg.mel_overlap:]
        return mel[:, :-self.cfg.mel_overlap]

    def _vocode(self, mels: dict[int, torch.Tensor], generators: dict[int, torch.Generator],
                states: list[DecodeState]) -> tuple[dict, dict]:
        """HiFT over each request's mel, one batch per mel length (its convs see the whole window)."""
        groups: dict[int, list[int]] = {}
        for i, mel in mels.items():
            groups.setdefault(mel.size(1), []).append(i)
        device = next(self.hift.parameters()).device
        order, speeches, sources = [], [], []
        for members in groups.values():
            caches = [states[i].hift_cache for i in members]
            speech, source = self.hift(torch.stack([mels[i] for i in members]).to(device),
                                       [generators[i] for i in members],
                                       [c.source if c is not None else None for c in caches])
            order += members
            speeches += list(speech)
            sources += list(source)
        host = to_host(speeches + sources)
        return dict(zip(order, host[:len(order)])), dict(zip(order, host[len(order):]))

    def _emit(self, s: DecodeState, b: Block, mel: torch.Tensor, speech: torch.Tensor,
              source: torch.Tensor) -> torch.Tensor:
        s.prompt_feat = torch.cat([s.prompt_feat, mel.T])
        if b.final:
            s.hift_cache = None
            return speech
        cache = self.cfg.mel_cache_frames
        samples = cache * self.cfg.hift.samples_per_frame
        s.hift_cache = HiFTCache(mel[:, -cache:], source[:, -samples:])
        return speech[:-samples]


def load_decoder(folder: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Glm4VoiceCodec:
    """`flow.pt` and `hift.pt` (upstream's state dicts, loaded strictly) from `folder`, at decoder_config's sizes."""
    cfg = decoder_config(folder)
    folder = Path(folder)

    def state(name: str) -> dict[str, torch.Tensor]:
        return torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)

    flow = XvecFlow(cfg.flow)
    flow.load_state_dict(state("flow"), strict=True)
    hift = HiFTGenerator(cfg.hift)
    hift.load_state_dict(fold_weight_norm(state("hift"), cfg.hift), strict=True)
    return Glm4VoiceCodec(cfg, flow.to(device, dtype).eval(), hift.to(device, dtype).eval())
