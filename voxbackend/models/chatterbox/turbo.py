"""Chatterbox-Turbo (Resemble AI): Chatterbox's T3 distilled onto GPT-2 medium, speaking the same 25 Hz S3 tokens,
decoded by S3Gen with meanflow (2 flow steps, no guidance); any voice from a reference clip.

Facts of the reference (`chatterbox-tts` 0.1.7, `ChatterboxTurboTTS.generate`, `T3.inference_turbo`):
- LM input (voxbackend.models.chatterbox.turbo_lm): the speaker embedding projected (1 row), the voice's conditioning
  speech tokens (its first 15 s, at most 375), the GPT-2 tokenizer's text ids (no start or end ids), the
  start-of-speech token 6561; then one speech token per step. GPT-2's learned position of the global position is
  the only position signal. Generation stops on 6562; the first sampled token plus at most 1000 more.
- No classifier-free guidance, no exaggeration, no min-p (upstream ignores them with a warning; here cfg_weight > 0
  is refused, spec.guidance False). Defaults: temperature 0.8, top-k 1000, top-p 0.95, repetition penalty 1.2.
- Tokens >= 6561 are dropped and three silence tokens (4299) appended before S3Gen (`tail_codes` here).
- Cloning: the clip must be longer than 5 s; T3's prompt tokens come from its first 15 s.

Here it is one engine id space: GPT-2 text ids [0, speech_base) with speech_base the tokenizer's size (50276), then
speech: speech_base + token (6563 of them). The prompt is ids but for the speaker row, a FEATURE row (its vector is
spkr_enc of the voice's embedding, computed at submission): [FEATURE, cond tokens as speech ids, text ids, start].
Sampled steps are speech ids and are fed back as they are.

Where this differs from the reference:
- Sampling order: upstream warps temperature -> top-k -> top-p and applies the repetition penalty after them (to
  the truncated logits), our engine penalizes first and truncates the penalized distribution. Temperature and the
  penalty commute (both keep signs), so greedy decoding is the same; sampled tokens follow slightly different
  distributions where the penalty reorders the top. Greedy parity holds against upstream with top_k=0, top_p=1.0:
  with truncation on, a top-p set of one (penalized) token keeps that token where argmax would pass it over.
- Penalty history: upstream's first step sees the start token, later steps only the generated tokens. The contract
  gives a model no per-request penalty, so here the history is the generated tokens only (penalty_on_prompt False;
  the prompt's cond tokens must not count either): the first step leaves the start token's logit unpenalized. Only
  a first step whose best token is the start token itself (which S3Gen drops anyway) can differ.
- A stop sampled as the very first token ends the request here; upstream only tests for the stop from the second
  token on (and then generates on past it).
- Blank text is refused (upstream substitutes a stock sentence); text is never truncated: a prompt that leaves no
  room for the 1001 speech tokens in the context (8196) is refused.
- The reference clip is not loudness-normalized to -27 LUFS (upstream: pyloudnorm, on by default) before cloning.

Checkpoint (the official folder): t3_turbo_v1.safetensors, s3gen_meanflow.safetensors (flow + HiFT, and the voice
front end's S3 tokenizer and CAMPPlus), ve.safetensors, the GPT-2 tokenizer (vocab.json + merges.txt and the added
tokens, or a tokenizer.json), conds.pt (the built-in voice), voices/<name>.safetensors; tiny test checkpoints add
t3_turbo.json (the backbone's GPT-2 config), s3gen.json and voice.json with their shrunken sizes.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from voxbackend.errors import InvalidRequest
from voxbackend.models.base import FEATURE, LMGeometry, ModelSpec, Prompt, WindowSpec
from voxbackend.models.chatterbox.model import (S3GEN_CONDITIONING, SPEAKER_EMB, VOICE_INPUT, ChatterboxVoices,
                                                S3GenDecoding, reference_input)
from voxbackend.models.chatterbox.s3gen import CONFIG_NAME as S3GEN_CONFIG
from voxbackend.models.chatterbox.s3gen import MEANFLOW_FILE, load_s3gen, s3gen_config
from voxbackend.models.chatterbox.turbo_lm import (COND_PROMPT_LEN, SPEAKER_EMBED, START_SPEECH, STOP_SPEECH,
                                                   WEIGHTS_FILE, TurboLM)
from voxbackend.models.chatterbox.turbo_text import TurboTokenizer
from voxbackend.models.chatterbox.voice import ChatterboxVoice, VoiceCloner
from voxbackend.models.decoder import DecoderConfig
from voxbackend.sampling_params import SamplingParams

SPEECH_VOCAB = 6563  # 6561 S3 codes, start, stop
MAX_SPEECH_TOKENS = 1001  # the first token, then at most max_gen_len (1000) more, the stop included
SILENCE = 4299  # S3Gen's silence token (upstream S3GEN_SIL)
TAIL_SILENCE = 3
GPT2_CONFIG = "t3_turbo.json"  # tiny checkpoints only: the official backbone is GPT2_MEDIUM
GPT2_MEDIUM = {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_embd": 1024,
               "hidden_size": 1024, "n_head": 16, "n_layer": 24, "n_positions": 8196, "n_ctx": 8196,
               "vocab_size": 50276}


def is_chatterbox_turbo_folder(folder: Path) -> bool:
    return all((Path(folder) / name).is_file() for name in (WEIGHTS_FILE, MEANFLOW_FILE))


class TurboVoice(ChatterboxVoice):
    max_cond_tokens = COND_PROMPT_LEN


class TurboVoiceCloner(VoiceCloner):
    """Chatterbox's cloning front end with Turbo's rules: clips over 5 s, T3 prompt tokens from the first 15 s."""

    MIN_REFERENCE_S = 5.0
    COND_SECONDS = 15
    S3GEN_FILE = MEANFLOW_FILE
    voice_type = TurboVoice


class ChatterboxTurboFrontend(ChatterboxVoices):
    """Tokenizer, voices, prompt rules and spec without the LM or S3Gen weights: the preprocess model's side."""

    request_inputs = (VOICE_INPUT, reference_input("5-30"))
    conditioning = (SPEAKER_EMB, *S3GEN_CONDITIONING)
    cloner_type = TurboVoiceCloner

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None):
        self.model_dir = Path(model_dir)
        gpt2 = self.model_dir / GPT2_CONFIG
        self.gpt2_config = json.loads(gpt2.read_text()) if gpt2.is_file() else GPT2_MEDIUM
        self.cfg = DecoderConfig.from_hf({**self.gpt2_config, "model_type": "gpt2"})
        self.tokenizer = TurboTokenizer(self.model_dir)
        self.speech_base = self.tokenizer.vocab_size
        s3gen_json = self.model_dir / S3GEN_CONFIG
        codec = s3gen_config(json.loads(s3gen_json.read_text()) if s3gen_json.is_file() else None, meanflow=True)
        hop = codec.stream.hop_tokens
        self.spec = ModelSpec(
            name="chatterbox_turbo",
            geometry=LMGeometry(self.cfg.num_layers, self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                                self.speech_base + SPEECH_VOCAB, self.cfg.max_position_embeddings),
            sample_rate=codec.hift.sampling_rate,
            codes_per_frame=1,
            window=WindowSpec(frames=hop, hop_frames=hop, first_frames=hop, flush_on_finish=True, stateful=True,
                              scheduled_by_model=True),
            stop_ids=(self.speech_base + STOP_SPEECH,),
            max_tokens=MAX_SPEECH_TOKENS,
            penalty_on_prompt=False,  # upstream never penalizes the voice's cond tokens (see the module docstring)
        )
        self.init_voices()

    def prepare(self, text: str, voice: str | None = None, reference_audio: bytes | None = None, *,
                text_open: bool = False) -> Prompt:
        text_ids = self.tokenizer.encode(self.check_text(text))
        v = self.voice(voice, reference_audio)
        base = self.speech_base
        prompt = [FEATURE, *(base + int(c) for c in v.cond_tokens), *text_ids, base + START_SPEECH]
        room = self.spec.geometry.max_context - len(prompt)
        if room < MAX_SPEECH_TOKENS:
            raise InvalidRequest(f"text is {len(text_ids)} tokens; with this voice Chatterbox-Turbo reads at most "
                                 f"{len(text_ids) + room - MAX_SPEECH_TOKENS}", field="text")
        return Prompt(prompt, self.voice_arrays(v), max_tokens=MAX_SPEECH_TOKENS)

    def check_conditioning(self, conditioning: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().check_conditioning(conditioning)
        self.check_voice_arrays(out)
        return out

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_k=1000, top_p=0.95, repetition_penalty=1.2,
                              max_tokens=MAX_SPEECH_TOKENS)


class ChatterboxTurbo(S3GenDecoding, ChatterboxTurboFrontend):
    tail_codes = (SILENCE,) * TAIL_SILENCE

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        super().__init__(model_dir, codec_dir)
        self.device = device
        self.codec = load_s3gen(self.model_dir, device, dtype, meanflow=True)
        if not lm:  # a codec stage's copy: detokenize only
            return
        self.lm = TurboLM.build(load_file(str(self.model_dir / WEIGHTS_FILE)), self.gpt2_config, device, dtype)
        text_rows, speech_rows = self.lm.text_emb.num_embeddings, self.lm.speech_emb.num_embeddings
        if text_rows < self.speech_base or speech_rows != SPEECH_VOCAB:
            raise ValueError(f"{WEIGHTS_FILE}: {text_rows} text and {speech_rows} speech embeddings; the tokenizer "
                             f"needs {self.speech_base} and Turbo {SPEECH_VOCAB}")
        self._speech_ids = self.speech_base + torch.arange(SPEECH_VOCAB, device=device)[None, :]

    @torch.inference_mode()
    def prompt_features(self, conditioning: dict[str, np.ndarray]) -> np.ndarray:
        spkr_enc = self.lm.spkr_enc
        speaker = torch.from_numpy(conditioning["speaker_emb"]).reshape(1, SPEAKER_EMBED)
        return spkr_enc(speaker.to(spkr_enc.weight.device, spkr_enc.weight.dtype)).float().cpu().numpy()

    def forward(self, input_ids, positions, attention, features=None):
        base, lm = self.speech_base, self.lm
        text = lm.text_emb(input_ids.clamp(0, base - 1))
        speech = lm.embed_speech((input_ids - base).clamp(0, SPEECH_VOCAB - 1))
        x = torch.where((input_ids >= base)[:, None], speech, text)
        if features is not None:
            x = x.index_copy(0, features.rows, features.vectors.to(x.dtype))
        return lm.forward_embeds(x, positions, attention)

    def candidate_logits(self, hidden: torch.Tensor, codes_so_far: list[int]):
        return self.lm.speech_logits(hidden), self._speech_ids.expand(len(hidden), -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((len(hidden), self.spec.geometry.vocab_size), float("-inf"), device=hidden.device)
        logits[:, self.speech_base:] = self.lm.speech_logits(hidden)
        return logits
