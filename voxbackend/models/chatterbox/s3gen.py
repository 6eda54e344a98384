"""Chatterbox's S3Gen: 25 Hz S3 speech tokens -> 24 kHz audio, on CosyVoice2's flow + HiFT (components/flow_hift).

Facts of the reference (`chatterbox-tts` 0.1.7, `S3Token2Wav`), and where they differ from CosyVoice2's token2wav:
- the same UpsampleConformerEncoder -> CausalConditionalCFM (10 Euler steps, cosine schedule, guidance 0.7) -> HiFT
  at 24 kHz, at CosyVoice2-0.5B's sizes, prompted by the voice's S3 tokens, its 2-frames-a-token 24 kHz mel and
  its 192-d CAMPPlus x-vector. `s3gen.safetensors` holds the whole module: `flow.*` and `mel2wav.*` are the
  upstream flow / HiFT names under a prefix (HiFT's convs weight-normed); `tokenizer.*` and `speaker_encoder.*`
  (the voice front end, voxbackend.models.chatterbox.voice) are not read here.
- no attention chunks (static_chunk_size 0): every window attends over all its tokens (`chunk_attention=False`).
- `finalize=False` encodes the last `pre_lookahead_len` (3) tokens like the others (the rest attend to them)
  and drops their frames (`encode_lookahead=True`); CosyVoice2 feeds them to the lookahead conv only. (0.1.7's
  own finalize=False path cannot run: its estimator mask keeps the untrimmed length, a shape error. The tests
  check ours against its flow with the mask cut to the trimmed length, which is what its docstring describes.)
- HiFT is CosyVoice 1's: the excitation's phase is a per-sample running sum (`phase_rate="sample"`).
- the utterance's first 40 ms are faded in (`trim_fade`: 20 ms of silence, then a 20 ms raised cosine) against
  spill-over from the reference clip; here the first samples of every stream get it, whichever windows they
  come in.
- the noise is `randn_like(mu)`, drawn afresh per call; here it is the flow's seeded buffer indexed by frame
  (prompt frames included), so a decode is deterministic and the tests give upstream the same draw.
- Chatterbox-Turbo (`s3gen_meanflow.safetensors`, `meanflow=True`): the estimator also embeds each step's end time
  and mixes the two embeddings (`time_embed_mixer`); 2 Euler steps on a linear schedule, no guidance. Upstream
  passes the noise after the prompt as `noised_mels`; here it is the same buffer.

Streaming (Token2Wav's schedule and API: `new_stream`, `window_due`, `decode` batched across requests): a window is
due when hop + 3 lookahead tokens are in; each window re-encodes prompt + all tokens so far and emits the hop's
mel, vocoded with HiFT's 8-frame cache and cross-fade; the last window takes the rest with finalize. Upstream has
no streaming in 0.1.7, so the first window is a plain hop (no padding to a chunk boundary, there are no chunks).
The streamed audio is NOT the whole-utterance audio, and cannot be: with full attention every frame of the
whole-utterance decode depends on every token, while a window's frames saw only the tokens up to its lookahead
(the final window, which sees all tokens, reproduces the whole-utterance mel for its frames exactly). On top
of that HiFT re-vocodes 8 frames per boundary and cross-fades, and draws its excitation noise window by window.
On the tiny test model (tests/test_chatterbox_s3gen.py) the windows' mel differ from the whole decode's by up to
0.12, shrinking toward the end, and per window the audio difference has 0.25-0.3 of the utterance's RMS (CFM;
0.04-0.1 with meanflow), the excitation noise alone accounting for most of it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from voxbackend.components.flow_hift.flow_matching import FlowMatching
from voxbackend.components.flow_hift.hift import HiFTGenerator, fold_weight_norm
from voxbackend.components.flow_hift.token2wav import DecodeStream, Token2Wav, Token2WavConfig

S3GEN_FILE, MEANFLOW_FILE, CONFIG_NAME = "s3gen.safetensors", "s3gen_meanflow.safetensors", "s3gen.json"
FLOW_PREFIX, HIFT_PREFIX = "flow.", "mel2wav."
SPEECH_TOKENS = 6561
TRIM_SAMPLES = 24000 // 50  # 20 ms of silence, then 20 ms of fade-in

# Chatterbox's differences from CosyVoice2-0.5B's Token2WavConfig (whose sizes it shares)
CHATTERBOX = {"flow": {"encode_lookahead": True, "chunk_attention": False}, "hift": {"phase_rate": "sample"},
              "stream": {"first_hop_tokens": 25}}
MEANFLOW = {"flow": {"n_timesteps": 2, "estimator": {"meanflow": True}}}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def s3gen_config(overrides: dict | None = None, meanflow: bool = False) -> Token2WavConfig:
    """The official sizes, with `overrides` (an s3gen.json: Token2WavConfig keys) on top."""
    data = _merge(CHATTERBOX, MEANFLOW) if meanflow else CHATTERBOX
    return Token2WavConfig.from_dict(_merge(data, overrides or {}))


def trim_fade() -> torch.Tensor:
    fade = torch.zeros(2 * TRIM_SAMPLES)
    fade[TRIM_SAMPLES:] = (torch.cos(torch.linspace(torch.pi, 0, TRIM_SAMPLES)) + 1) / 2
    return fade


class S3Gen(Token2Wav):
    """Token2Wav with the stream start faded in."""

    def __init__(self, cfg: Token2WavConfig, flow: FlowMatching, hift: HiFTGenerator):
        super().__init__(cfg, flow, hift)
        self.fade = trim_fade()

    def _emitted(self, stream: DecodeStream) -> int:
        """Samples this stream has returned so far: all its windows' audio but the HiFT overlap held back."""
        if stream.hift_cache is None:
            return 0
        overlap = self.cfg.stream.mel_cache_frames * self.cfg.hift.samples_per_frame
        return stream.token_offset * self.flow.cfg.token_mel_ratio * self.cfg.hift.samples_per_frame - overlap

    def decode(self, streams: list[DecodeStream]) -> list[torch.Tensor]:
        starts = [self._emitted(s) for s in streams]
        audio = super().decode(streams)
        for i, start in enumerate(starts):
            n = min(len(audio[i]), len(self.fade) - start)
            if n > 0:
                audio[i] = audio[i].clone()
                audio[i][:n] *= self.fade[start:start + n]
        return audio


def _read(path: Path) -> dict[str, torch.Tensor]:
    """The flow and HiFT tensors only (the front end's are someone else's)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith((FLOW_PREFIX, HIFT_PREFIX))}


def load_s3gen(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               meanflow: bool = False) -> S3Gen:
    """`folder/s3gen.safetensors` (Turbo: `s3gen_meanflow.safetensors`), the official file, with an optional
    `folder/s3gen.json` (Token2WavConfig keys over the official sizes; tiny test checkpoints)."""
    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    cfg = s3gen_config(json.loads(config_path.read_text()) if config_path.is_file() else None, meanflow)
    state = _read(folder / (MEANFLOW_FILE if meanflow else S3GEN_FILE))
    flow = FlowMatching(cfg.flow)
    flow.load_state_dict({k.removeprefix(FLOW_PREFIX): v for k, v in state.items() if k.startswith(FLOW_PREFIX)},
                         strict=True)
    hift = HiFTGenerator(cfg.hift)
    hift.load_state_dict(fold_weight_norm({k.removeprefix(HIFT_PREFIX): v for k, v in state.items()
                                           if k.startswith(HIFT_PREFIX)}, cfg.hift), strict=True)
    return S3Gen(cfg, flow.to(device, dtype).eval(), hift.to(device, dtype).eval())
