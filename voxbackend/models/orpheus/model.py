"""Orpheus-3B: a Llama-3.2 backbone that speaks SNAC 24 kHz codes, 7 tokens per 85 ms frame.

Prompt, token layout, windowing and default sampling follow the official implementation (canopylabs
orpheus-tts): the prompt is <start_of_human> "{voice}: {text}" <eot><end_of_human><start_of_ai><start_of_speech>;
audio token t at position p of its frame is code t - 128266 - 4096 * p; every new frame, the last 4 frames are
decoded and samples 2048-4096 (the second frame) are played.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from voxbackend.models.orpheus.snac import SnacDecoder
from voxbackend.errors import InvalidRequest
from voxbackend.ints import long_tensor
from voxbackend.models.base import ModelSpec, SpeechModel, WindowJob, WindowSpec
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.text_tokens import TextTokenizer
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

VOCAB_SIZE = 156940
BEGIN_OF_TEXT = 128000  # <|begin_of_text|>: the official code's tokenizer call adds it
START_OF_HUMAN = 128259
PROMPT_END = (128009, 128260, 128261, 128257)  # <eot>, <end_of_human>, <start_of_ai>, <start_of_speech>
END_OF_SPEECH = 128258
AUDIO_BASE = 128266
CODEBOOK = 4096
FRAME = 7  # tokens per SNAC frame: 1 + 2 + 4 codes of the three SNAC levels
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
KEEP = slice(2048, 4096)  # samples of a 4-frame window that are played
MAX_TOKENS = 1200  # the official engine's max_tokens (about 14 s of audio)


def is_orpheus_config(hf_config: dict) -> bool:
    llama = "LlamaForCausalLM" in (hf_config.get("architectures") or ()) or hf_config.get("model_type") == "llama"
    return llama and hf_config.get("vocab_size") == VOCAB_SIZE


CODEC_FOLDERS = ("snac_24khz", "snac")  # where the codec is looked for, next to or inside the checkpoint


def find_codec(model_dir: Path, codec_dir: str | Path | None) -> Path:
    """The SNAC 24 kHz folder: the one given, else one of CODEC_FOLDERS in or next to the checkpoint."""
    if codec_dir:
        return Path(codec_dir)
    for base in (model_dir, model_dir.parent):
        for name in CODEC_FOLDERS:
            if (base / name / "config.json").is_file():
                return base / name
    raise FileNotFoundError(
        f"Orpheus needs the SNAC 24 kHz codec folder (hubertsiuzdak/snac_24khz); pass codec_dir or put it "
        f"at {model_dir / 'snac_24khz'}"
    )


def frames_to_snac_codes(codes: np.ndarray, device: str) -> list[torch.Tensor]:
    """[B, frames, 7] Orpheus codes -> the three SNAC levels [B, F], [B, 2F], [B, 4F]."""
    c = torch.as_tensor(codes, dtype=torch.long, device=device)
    b = c.shape[0]
    return [c[:, :, 0], c[:, :, [1, 4]].reshape(b, -1), c[:, :, [2, 3, 5, 6]].reshape(b, -1)]


class OrpheusFrontend(SpeechModel):
    """Tokenizer, prompt rules and spec without any weights: what preprocessing instances need."""

    voices = VOICES
    request_inputs = (
        TensorSpec("VOICE", "STRING", optional=True, doc="one of the model's voices; model default when absent",
                   arg="voice"),
    )

    def __init__(self, model_dir: str | Path, codec_dir: str | Path):
        self.cfg = DecoderConfig.from_hf(read_config(model_dir), family="llama")
        tokenizer_file = Path(model_dir) / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.text_tokenizer = TextTokenizer(self.tokenizer)  # user text never becomes a control token
        self.spec = ModelSpec(
            name="orpheus",
            geometry=self.cfg.geometry(),
            sample_rate=read_config(codec_dir).get("sampling_rate", 24000),
            codes_per_frame=FRAME,
            window=WindowSpec(frames=4, hop_frames=1, first_frames=4, flush_on_finish=False),
            stop_ids=(END_OF_SPEECH,),
            max_tokens=MAX_TOKENS,
        )

    def prepare(self, text: str, voice: str | None = None) -> list[int]:
        self.check_text(text)
        voice = voice or VOICES[0]
        if voice not in VOICES:
            raise InvalidRequest(f"unknown voice {voice!r}; choose one of {', '.join(VOICES)}", field="voice")
        ids = [START_OF_HUMAN, BEGIN_OF_TEXT, *self.text_tokenizer.encode(f"{voice}: {text}"), *PROMPT_END]
        if len(ids) >= self.spec.geometry.max_context:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens; the model's context is {self.spec.geometry.max_context}"
            )
        return ids

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, max_tokens=MAX_TOKENS)


class Orpheus(OrpheusFrontend):
    def __init__(
        self,
        model_dir: str | Path,
        codec_dir: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        constrain_audio: bool = True,
        lm: bool = True,
    ):
        super().__init__(model_dir, codec_dir)
        self.device = device
        self.codec = SnacDecoder.from_pretrained(codec_dir, device=device, dtype=dtype)
        if self.codec.sample_rate != self.spec.sample_rate:
            raise ValueError(f"codec sample rate {self.codec.sample_rate} != {self.spec.sample_rate}")
        if not lm:  # a codec stage's copy: detokenize only
            return
        self.backbone = build_decoder(self.cfg, load_safetensors(model_dir), device, dtype)
        # Real Orpheus weights emit well-formed frames on their own; the mask only removes impossible tokens.
        self.constrain_audio = constrain_audio
        # lm_head rows of the stop token and of each codebook position, so constrained steps skip the rest
        head = self.backbone.lm_head.weight
        self._stop_head = head[END_OF_SPEECH]
        self._code_heads = head[AUDIO_BASE : AUDIO_BASE + FRAME * CODEBOOK].view(FRAME, CODEBOOK, -1)
        self._codebook_offsets = torch.arange(CODEBOOK, device=device)[None, :]
        self._stop = torch.tensor([[END_OF_SPEECH]], device=device)

    def forward(self, input_ids, positions, attention):
        return self.backbone(input_ids, positions, attention)

    def logits(self, hidden):
        return self.backbone.logits(hidden)

    def candidate_logits(self, hidden: torch.Tensor, codes_so_far: list[int]):
        if not self.constrain_audio:
            return self.logits(hidden), None
        # The next token is the stop token (at a frame's start only) or a code of codebook position p: score just
        # those 4097 rows of the head, one matmul per position present in the batch (7x less work than all 28,684
        # audio rows).
        # Positions come from the host, so grouping rows by position needs no device read-back.
        positions = [c % FRAME for c in codes_so_far]
        device = hidden.device
        logits = torch.empty(len(hidden), CODEBOOK + 1, device=device, dtype=torch.float32)
        logits[:, 0] = (hidden @ self._stop_head).float()
        present = sorted(set(positions))
        if len(present) == 1:  # the whole batch at one position: no row gather
            logits[:, 1:] = (hidden @ self._code_heads[present[0]].T).float()
        else:
            for p in present:
                rows = long_tensor([i for i, q in enumerate(positions) if q == p], device)
                logits[rows, 1:] = (hidden[rows] @ self._code_heads[p].T).float()
        mid_frame = [i for i, p in enumerate(positions) if p]
        if mid_frame:  # a stream ends between frames: a stop inside one would drop the frame's codes so far
            logits[long_tensor(mid_frame, device), 0] = float("-inf")
        first = AUDIO_BASE + CODEBOOK * long_tensor(positions, device)[:, None]
        ids = torch.cat([self._stop.expand(len(hidden), 1), first + self._codebook_offsets], 1)
        return logits, ids  # ids ascending per row (the stop id is below every audio id)

    def codes_from_step(self, token: int, codes_so_far: int) -> list[int]:
        code = token - AUDIO_BASE - CODEBOOK * (codes_so_far % FRAME)
        return [code] if 0 <= code < CODEBOOK else []

    def use_graphs(self, depth_sizes: list[int], codec_sizes: list[int], capture: bool) -> None:
        self.codec.use_buckets(codec_sizes, capture)  # every window is 4 frames: a fixed shape per batch size

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        codes = np.stack([j.codes for j in jobs])  # every Orpheus window is 4 frames
        audio = self.codec.decode(frames_to_snac_codes(codes, self.device), [j.seed for j in jobs])
        return list(audio[:, 0, KEEP].float().cpu().numpy())
