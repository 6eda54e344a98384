"""Qwen3-TTS-12Hz served by the engine: the frontend's prompt and text track, the paged talker with its code
predictor on the device, and the exactly streaming 12 Hz codec (one state per request).

Sampling of codebook 0 follows the reference generate: ids 2048-3071 other than EOS are suppressed (only the 2048
codes and EOS are candidates) and EOS is masked in the first MIN_NEW_TOKENS frames. Codebooks 1-15 are sampled by
the predictor with the request's temperature, top-k and top-p, without repetition penalty. Base checkpoints
(voice cloning) add the reference x-vector at the prompt's FEATURE row and start each stream's codec state after
the reference codes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from voxbackend.models.qwen3_tts.codec import Qwen3TTSCodec
from voxbackend.ints import to_host
from voxbackend.models.base import WindowJob
from voxbackend.models.qwen3_tts.talker import Qwen3TTSTalker
from voxbackend.models.qwen3_tts.frontend import MIN_NEW_TOKENS, Qwen3TTSFrontend, find_speech_tokenizer


class Qwen3TTS(Qwen3TTSFrontend):
    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        super().__init__(model_dir, codec_dir)
        self.device = device
        self.codec = Qwen3TTSCodec.from_pretrained(find_speech_tokenizer(Path(model_dir), codec_dir), device=device,
                                                   dtype=dtype)
        if not lm:  # a codec stage's copy: detokenize only
            return
        self.talker = Qwen3TTSTalker(model_dir, device, dtype)
        self.depth_columns = self.talker.depth_columns
        codes = self.talker.code_size
        self.candidates = torch.cat([torch.arange(codes), torch.tensor([self.eos])]).to(device)  # ascending

    # ---------------------------------------------------------------- LM
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention, features=None) -> torch.Tensor:
        return self.talker.forward(input_ids, positions, attention, features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.talker.logits(hidden)

    def candidate_logits(self, hidden: torch.Tensor, codes_so_far: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2048 codes and EOS (the reference suppresses the other specials); EOS masked in the first frames."""
        b = len(codes_so_far)
        logits = self.logits(hidden)[:, self.candidates]
        early = [i for i, n in enumerate(codes_so_far) if n // self.groups < MIN_NEW_TOKENS]
        if early:
            logits[torch.tensor(early, device=logits.device), -1] = float("-inf")
        return logits, self.candidates.expand(b, -1).contiguous()

    def depth_step(self, hidden: torch.Tensor, first: torch.Tensor, sample_column) -> torch.Tensor:
        codes = self.talker.predict_codes(hidden, first, sample_column)
        return torch.cat([codes, torch.full_like(first, -1)[:, None]], dim=1)  # next_input fills the text column

    # ---------------------------------------------------------------- codec
    def new_codec_state(self, conditioning):
        """Base: the state after the reference clip's codes (decoded, the audio dropped), so the stream continues
        the reference's decode of reference codes + generated codes with the reference part cut off. Priming runs
        the synthesis stages over the reference's last frames only (Qwen3TTSCodec.prime)."""
        state = self.codec.new_state()
        reference = conditioning.get("reference_codes")
        if reference is not None:
            self.codec.prime(state, torch.as_tensor(reference, dtype=torch.long, device=self.device))
        return state

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        """Windows of different requests (any lengths) in one codec call, each continuing its request's state."""
        windows = [torch.as_tensor(j.codes, dtype=torch.long, device=self.device) for j in jobs]
        audio = self.codec.decode_window([j.state for j in jobs], windows)
        return [a.numpy() for a in to_host(audio)]
