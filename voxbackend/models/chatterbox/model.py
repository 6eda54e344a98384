"""Chatterbox (Resemble AI): the T3 LM (Llama-520M) speaks 25 Hz S3 speech tokens with classifier-free guidance,
decoded by S3Gen (flow matching + HiFT, 24 kHz); any voice from a reference clip.

Facts of the reference (`chatterbox-tts` 0.1.7, `ChatterboxTTS.generate`, `T3.inference`):
- LM input: a 34-row conditioning prefix (the voice encoder's speaker embedding projected, the voice's prompt speech
  tokens through a perceiver resampler, the exaggeration scalar projected), the text between start (255) and end (0)
  ids with its own learned positions, then the start-of-speech token 6561 (twice: once as the prompt's speech part,
  once as the first input of generation, both at learned speech position 0) and one speech token per step at
  positions 1, 2, ... Generation stops on 6562, at most 1000 steps.
- Guidance: a second row with the text embeddings zeroed (its text positions kept); logits = cond + w * (cond -
  uncond), w = cfg_weight (0.5); both rows are fed the sampled token. Then repetition penalty 1.2 over the start
  token and the generated ones, temperature 0.8, min-p 0.05, top-p 1.0.
- Tokens >= 6561 that are not the stop are dropped before S3Gen.
Here it is one engine id space: text ids [0, 704), TEXT_BLANK (an unconditioned text row: position embedding only),
then speech: SPEECH_BASE + index * 8194 + token is token at learned speech position `index`. The head's candidates are
the index-0 ids (SPEECH_BASE + token), so sampled steps, stop ids and the penalty history are plain speech ids; the
model packs the position in when it feeds a step back (`next_input`, counted by the request's track). The prefix rows
are FEATURE rows computed at submission; the text rows' positions are the sequence position minus the prefix.

Checkpoint (the official folder): t3_cfg.safetensors, s3gen.safetensors, ve.safetensors, tokenizer.json, conds.pt
(the built-in voice), voices/<name>.safetensors for named voices; tiny test checkpoints add t3.json (the backbone's
Llama config), s3gen.json and voice.json with their shrunken sizes.

`ChatterboxVoices` (voices, the S3Gen conditioning arrays) and `S3GenDecoding` (the codec side) are shared with
Chatterbox-Turbo (voxbackend.models.chatterbox.turbo).
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from voxbackend.errors import InvalidRequest
from voxbackend.models.base import FEATURE, LMGeometry, ModelSpec, Prompt, SpeechModel, WindowJob, WindowSpec
from voxbackend.models.chatterbox.s3gen import CONFIG_NAME as S3GEN_CONFIG
from voxbackend.models.chatterbox.s3gen import S3Gen, load_s3gen, s3gen_config
from voxbackend.models.chatterbox.t3_lm import (COND_PROMPT_LEN, COND_ROWS, LLAMA_520M, SPEAKER_EMBED, SPEECH_VOCAB,
                                                START_SPEECH, STOP_SPEECH, TEXT_VOCAB, WEIGHTS_FILE, T3LM)
from voxbackend.models.chatterbox.text import START_TEXT, STOP_TEXT, ChatterboxTokenizer
from voxbackend.models.chatterbox.voice import ChatterboxVoice, VoiceCloner
from voxbackend.models.named_voices import VOICES_DIR
from voxbackend.models.decoder import DecoderConfig
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

S3_CODES = 6561  # S3 tokenizer v2 codes: the speech ids S3Gen decodes
TEXT_BLANK = TEXT_VOCAB
SPEECH_BASE = TEXT_VOCAB + 1
MAX_SPEECH_TOKENS = 1000  # the reference's cap per utterance
MAX_TEXT_ROWS = 2050  # learned text positions: the text ids plus start and end
MAX_EXAGGERATION = 2.0
LLAMA_CONFIG = "t3.json"  # tiny checkpoints only: the official backbone is Llama-520M


def is_chatterbox_folder(folder: Path) -> bool:
    return all((Path(folder) / name).is_file() for name in (WEIGHTS_FILE, "s3gen.safetensors", "tokenizer.json"))


@dataclass
class SpeechCursor:
    """A request's next learned speech position (the start token took 0)."""

    next_index: int = 1


VOICE_INPUT = TensorSpec("VOICE", "STRING", optional=True, arg="voice",
                         doc="a named voice (voices/<name>.safetensors in the checkpoint, or one cloned earlier under "
                             "this name); absent: the built-in voice (conds.pt); with REFERENCE_AUDIO: the name the "
                             "clone is kept under")


def reference_input(seconds: str) -> TensorSpec:
    return TensorSpec("REFERENCE_AUDIO", "STRING", optional=True, arg="reference_audio", kind="audio",
                      doc=f"voice cloning: a WAV/FLAC/OGG clip of {seconds} s (any rate); no transcript needed")


SPEAKER_EMB = TensorSpec("SPEAKER_EMB", "FP32", (SPEAKER_EMBED,), arg="speaker_emb",
                         doc="the voice encoder's embedding")
# what S3Gen needs of a voice
S3GEN_CONDITIONING = (
    TensorSpec("PROMPT_SPEECH_TOKENS", "INT32", (-1,), arg="prompt_speech_tokens",
               doc="the voice's 25 Hz speech tokens (S3Gen prompt)"),
    TensorSpec("PROMPT_FEAT", "FP32", (-1, 80), arg="prompt_feat", doc="the voice's 50 Hz mel, 2 frames a token"),
    TensorSpec("SPEAKER_EMBEDDING", "FP32", (-1,), arg="speaker_embedding", doc="the voice's CAMPPlus x-vector"),
)


class ChatterboxVoices(SpeechModel):
    """What Chatterbox and Chatterbox-Turbo share before the LM: voices (conds.pt, voices/, clones of a clip), the
    voice arrays a prompt carries and their checks, and speech ids as S3 codes (`speech_base` + code)."""

    cloner_type: type[VoiceCloner] = VoiceCloner
    speech_base: int

    def init_voices(self) -> None:
        self.voices_dir = self.model_dir / VOICES_DIR
        self.voices = tuple(sorted(p.stem for p in self.voices_dir.glob("*.safetensors")))
        self._cloner: VoiceCloner | None = None
        self._cloner_lock = threading.Lock()

    def cloner(self) -> VoiceCloner:
        """The voice encoder + S3 tokenizer + CAMPPlus front end, loaded on the first request that needs it."""
        with self._cloner_lock:
            if self._cloner is None:
                self._cloner = self.cloner_type.from_folder(self.model_dir)
        return self._cloner

    def voice(self, name: str | None, audio: bytes | None) -> ChatterboxVoice:
        if audio is None and self._cloner is None:  # built-in and stored voices need none of the networks
            voice_type = self.cloner_type.voice_type
            if name is None and (self.model_dir / "conds.pt").is_file():
                return voice_type.from_conds(self.model_dir / "conds.pt")
            if name in self.voices:
                return voice_type.load(self.voices_dir / f"{name}.safetensors")
        return self.cloner().voice(name, audio)

    @staticmethod
    def voice_arrays(v: ChatterboxVoice) -> dict[str, np.ndarray]:
        """The T3 speaker embedding and S3Gen's prompt of a voice, as Prompt.conditioning."""
        return {
            "speaker_emb": v.speaker_emb.numpy().astype(np.float32).reshape(SPEAKER_EMBED),
            "prompt_speech_tokens": v.prompt_tokens.numpy().astype(np.int32),
            "prompt_feat": v.prompt_feat.numpy().astype(np.float32),
            "speaker_embedding": v.xvector.numpy().astype(np.float32).reshape(-1),
        }

    def check_voice_arrays(self, out: dict[str, np.ndarray]) -> None:
        tokens = out["prompt_speech_tokens"]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= S3_CODES):
            raise InvalidRequest(f"prompt_speech_tokens must be in [0, {S3_CODES})", field="prompt_speech_tokens")
        if out["prompt_feat"].shape[0] != 2 * tokens.size:
            raise InvalidRequest(f"prompt_feat has {out['prompt_feat'].shape[0]} frames; 2 per prompt speech token "
                                 f"({2 * tokens.size}) are needed", field="prompt_feat")
        if not all(np.isfinite(out[k]).all() for k in ("speaker_emb", "prompt_feat", "speaker_embedding")):
            raise InvalidRequest("the voice's arrays must be finite", field="speaker_emb")

    def codes_from_step(self, step: int, codes_so_far: int) -> list[int]:
        code = step - self.speech_base
        return [code] if 0 <= code < S3_CODES else []


class ChatterboxFrontend(ChatterboxVoices):
    """Tokenizer, voices, prompt rules and spec without the LM or S3Gen weights: the preprocess model's side."""

    request_inputs = (
        VOICE_INPUT,
        reference_input("1-30"),
        TensorSpec("EXAGGERATION", "FP32", optional=True, arg="exaggeration",
                   doc=f"emotion exaggeration in [0, {MAX_EXAGGERATION:g}]; 0.5 (default) is neutral"),
    )
    conditioning = (
        SPEAKER_EMB,
        TensorSpec("COND_TOKENS", "INT32", (-1,), arg="cond_tokens",
                   doc=f"the voice's first 6 s as S3 tokens (1-{COND_PROMPT_LEN}), for the LM's perceiver"),
        TensorSpec("EMOTION_ADV", "FP32", (1,), arg="emotion_adv", doc="the request's exaggeration"),
        *S3GEN_CONDITIONING,
    )
    speech_base = SPEECH_BASE

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None):
        self.model_dir = Path(model_dir)
        llama = self.model_dir / LLAMA_CONFIG
        self.llama_config = json.loads(llama.read_text()) if llama.is_file() else LLAMA_520M
        self.cfg = DecoderConfig.from_hf(self.llama_config, "llama")
        self.tokenizer = ChatterboxTokenizer(self.model_dir / "tokenizer.json")
        s3gen_json = self.model_dir / S3GEN_CONFIG
        codec = s3gen_config(json.loads(s3gen_json.read_text()) if s3gen_json.is_file() else None)
        hop = codec.stream.hop_tokens
        self.spec = ModelSpec(
            name="chatterbox",
            geometry=LMGeometry(self.cfg.num_layers, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                                SPEECH_BASE + SPEECH_VOCAB, COND_ROWS + MAX_TEXT_ROWS + 2 + MAX_SPEECH_TOKENS),
            sample_rate=codec.hift.sampling_rate,
            codes_per_frame=1,
            window=WindowSpec(frames=hop, hop_frames=hop, first_frames=hop, flush_on_finish=True, stateful=True,
                              scheduled_by_model=True),
            stop_ids=(SPEECH_BASE + STOP_SPEECH,),
            max_tokens=MAX_SPEECH_TOKENS,
            guidance=True,
        )
        self.init_voices()

    # ---------------------------------------------------------------- preprocessing
    def prepare(self, text: str, voice: str | None = None, reference_audio: bytes | None = None,
                exaggeration: float | None = None, *, text_open: bool = False) -> Prompt:
        text_ids = self.tokenizer.encode(self.check_text(text))
        if len(text_ids) + 2 > MAX_TEXT_ROWS:
            raise InvalidRequest(f"text is {len(text_ids)} tokens; Chatterbox reads at most {MAX_TEXT_ROWS - 2}",
                                 field="text")
        v = self.voice(voice, reference_audio)
        # the start-of-speech row twice, both at speech position 0, as the reference builds its first input
        prompt = [FEATURE] * COND_ROWS + [START_TEXT, *text_ids, STOP_TEXT] + [SPEECH_BASE + START_SPEECH] * 2
        conditioning = {**self.voice_arrays(v), "cond_tokens": v.cond_tokens.numpy().astype(np.int32),
                        "emotion_adv": np.array([check_exaggeration(exaggeration)], dtype=np.float32)}
        return Prompt(prompt, conditioning, max_tokens=MAX_SPEECH_TOKENS)

    def check_conditioning(self, conditioning: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().check_conditioning(conditioning)
        cond = out["cond_tokens"]
        if not 1 <= cond.size <= COND_PROMPT_LEN or cond.min() < 0 or cond.max() >= S3_CODES:
            raise InvalidRequest(f"cond_tokens must be 1-{COND_PROMPT_LEN} ids in [0, {S3_CODES})",
                                 field="cond_tokens")
        check_exaggeration(float(out["emotion_adv"][0]), field="emotion_adv")
        self.check_voice_arrays(out)
        return out

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.8, min_p=0.05, top_p=1.0, repetition_penalty=1.2, cfg_weight=0.5,
                              max_tokens=MAX_SPEECH_TOKENS)

    # ---------------------------------------------------------------- the next input
    def split_prompt(self, prompt: list, text_open: bool) -> tuple[list, SpeechCursor]:
        return prompt, SpeechCursor()

    def next_input(self, step: int, track: SpeechCursor) -> int:
        index, track.next_index = track.next_index, track.next_index + 1
        return step + index * SPEECH_VOCAB

    def unconditioned_prompt(self, prompt: list) -> list:
        """The text rows lose their ids (start and end included), as the reference zeroes the text embeddings."""
        return [TEXT_BLANK if 0 <= i < TEXT_VOCAB else i for i in prompt]


def check_exaggeration(value, field: str = "exaggeration") -> float:
    if value is None:
        return 0.5
    try:
        value = float(np.asarray(value).reshape(-1)[0]) if not isinstance(value, (int, float)) else float(value)
    except (TypeError, ValueError, IndexError):
        raise InvalidRequest(f"{field} must be a number", field=field) from None
    if not math.isfinite(value) or not 0 <= value <= MAX_EXAGGERATION:
        raise InvalidRequest(f"{field} must be in [0, {MAX_EXAGGERATION:g}], got {value}", field=field)
    return value


class S3GenDecoding:
    """The codec side of a served Chatterbox model: S3Gen (`self.codec`) decodes each request's S3 codes as they
    come, in windows the stream schedules; `tail_codes` are appended when the LM is done (Turbo: silence)."""

    codec: S3Gen
    tail_codes: tuple[int, ...] = ()

    def new_codec_state(self, conditioning):
        # windows as a complete token sequence is cut: the audio does not depend on when tokens arrived
        return self.codec.new_stream(conditioning["prompt_speech_tokens"], conditioning["prompt_feat"],
                                     conditioning["speaker_embedding"], as_complete=True)

    def windows_ready(self, state, codes: list[int], lm_done: bool) -> int:
        if len(codes) > len(state.tokens):
            state.push(codes[len(state.tokens):])
        if lm_done and not state.ended:
            state.push(self.tail_codes)
            state.end()
        return 1 if self.codec.window_due(state) else 0

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        for job in jobs:
            if job.index == 0:  # the request's HiFT excitation noise follows its seed
                job.state.generator.manual_seed(job.seed)
        return [a.numpy().astype(np.float32, copy=False) for a in self.codec.decode([j.state for j in jobs])]


class Chatterbox(S3GenDecoding, ChatterboxFrontend):
    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        super().__init__(model_dir, codec_dir)
        self.device = device
        self.codec = load_s3gen(self.model_dir, device, dtype)
        if not lm:  # a codec stage's copy: detokenize only
            return
        self.lm = T3LM.build(load_file(str(self.model_dir / WEIGHTS_FILE)), self.llama_config, device, dtype)
        self._speech_ids = SPEECH_BASE + torch.arange(SPEECH_VOCAB, device=device)[None, :]

    # ---------------------------------------------------------------- LM
    @torch.inference_mode()
    def prompt_features(self, conditioning: dict[str, np.ndarray]) -> np.ndarray:
        rows = self.lm.cond_embeds(torch.from_numpy(conditioning["speaker_emb"]),
                                   torch.from_numpy(conditioning["cond_tokens"].astype(np.int64)),
                                   float(conditioning["emotion_adv"][0]))
        return rows.float().cpu().numpy()

    def forward(self, input_ids, positions, attention, features=None):
        lm = self.lm
        text = lm.embed_text(input_ids.clamp(0, TEXT_VOCAB - 1),
                             (positions - COND_ROWS).clamp(0, lm.max_text_index - 1), input_ids == TEXT_BLANK)
        packed = (input_ids - SPEECH_BASE).clamp(min=0)
        speech = lm.embed_speech(packed % SPEECH_VOCAB, (packed // SPEECH_VOCAB).clamp(max=lm.max_speech_index - 1))
        x = torch.where((input_ids >= SPEECH_BASE)[:, None], speech, text)
        if features is not None:
            x = x.index_copy(0, features.rows, features.vectors.to(x.dtype))
        return lm.forward_embeds(x, positions, attention)

    def candidate_logits(self, hidden: torch.Tensor, codes_so_far: list[int]):
        return self.lm.speech_logits(hidden), self._speech_ids.expand(len(hidden), -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((len(hidden), self.spec.geometry.vocab_size), float("-inf"), device=hidden.device)
        logits[:, SPEECH_BASE:] = self.lm.speech_logits(hidden)
        return logits
