"""Step-Audio 2 mini: a Qwen2.5-7B-shaped LM that hears audio (the audio encoder's rows at the prompt's
placeholder rows) and answers with text ids interleaved with audio ids (S3 codes from AUDIO_OFFSET), ending at
`<|EOT|>`.

So far the model serves its LM (text and audio ids out, through the engine's FEATURE rows): speaking the audio ids
(token2wav), the text as its own response field, and the Triton contract are still to come. The audio encoder runs
in prepare(), one request at a time (where a preprocess model would run it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from voxbackend.errors import InvalidRequest
from voxbackend.models.base import ModelSpec, Prompt, PromptFeatures, SpeechModel
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.step_audio2.audio_encoder import SAMPLE_RATE, load_audio_encoder
from voxbackend.models.step_audio2.chat import ChatTemplate, Turn
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

AUDIO_OFFSET = 151696  # the first audio id: S3 code 0 of CosyVoice2's 6561-code tokenizer
AUDIO_CODES = 6561
MAX_CLIP_S = 60.0
MAX_TOKENS = 4096  # upstream's cap for a spoken reply


def is_step_audio2_config(hf_config: dict) -> bool:
    """The official config.json nests the LM's and the audio encoder's settings."""
    return "text_config" in hf_config and "audio_encoder_config" in hf_config


class StepAudio2(SpeechModel):
    conditioning = (TensorSpec("AUDIO_ROWS", "FP32", (-1, -1), optional=True, arg="audio_rows",
                               doc="the audio encoder's rows for the prompt's placeholders, in prompt order"),)

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        model_dir = Path(model_dir)
        hf = read_config(model_dir)
        if not is_step_audio2_config(hf):
            raise ValueError(f"{model_dir}/config.json has no text_config and audio_encoder_config: not Step-Audio 2")
        self.cfg = DecoderConfig.from_hf(hf["text_config"], family="qwen2")
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self.template = ChatTemplate(Tokenizer.from_file(str(tokenizer_file)))
        self.spec = ModelSpec(name="step_audio2", geometry=self.cfg.geometry(), sample_rate=24000, codes_per_frame=1,
                              window=None, stop_ids=(self.template.eot,), max_tokens=MAX_TOKENS)
        weights = load_safetensors(model_dir)
        self.audio_encoder = load_audio_encoder(hf, weights, device, dtype)
        if lm:
            self.backbone = build_decoder(self.cfg, weights, device, dtype)

    def prepare(self, text: str | None = None, voice: str | None = None, *, audio: np.ndarray | None = None,
                system: str | None = None, speak: bool = True) -> Prompt:
        """One user turn (its text, its 16 kHz clip, or both) after an optional system prompt; the assistant's
        turn is opened for a spoken reply (`speak`) or a text one."""
        content: list = []
        if text:
            content.append(self.check_text(text))
        if audio is not None:
            audio = np.asarray(audio, dtype=np.float32)
            if audio.ndim != 1 or audio.size == 0:
                raise InvalidRequest("audio must be a non-empty mono clip", field="audio")
            if audio.size > MAX_CLIP_S * SAMPLE_RATE:
                raise InvalidRequest(f"audio is {audio.size / SAMPLE_RATE:.1f} s; the limit is {MAX_CLIP_S:.0f} s",
                                     field="audio")
            content.append(audio)
        if not content:
            raise InvalidRequest("give text, audio or both", field="text")
        turns = [Turn("system", self.check_text(system, "system"))] if system else []
        turns += [Turn("user", content), Turn("assistant", [[self.template.tts_start]] if speak else [], ends=False)]
        chat = self.template.render(turns)
        if len(chat.ids) >= self.spec.geometry.max_context:
            raise InvalidRequest(f"prompt is {len(chat.ids)} tokens; the model's context is "
                                 f"{self.spec.geometry.max_context}", field="text")
        conditioning = {}
        if chat.mels:
            rows = torch.cat(self.audio_encoder(chat.mels))
            conditioning["audio_rows"] = rows.float().cpu().numpy()
        return Prompt(chat.ids, conditioning)

    def prompt_features(self, conditioning: dict[str, np.ndarray]) -> np.ndarray | None:
        return conditioning.get("audio_rows")

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.05, max_tokens=MAX_TOKENS)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                features: PromptFeatures | None = None) -> torch.Tensor:
        x = self.backbone.embed(input_ids.clamp(min=0))  # FEATURE rows (negative ids) get their vectors below
        if features is not None:
            x = x.index_copy(0, features.rows, features.vectors.to(x.dtype))
        return self.backbone.forward_embeds(x, positions, attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backbone.logits(hidden)

    @staticmethod
    def audio_codes(ids: list[int]) -> list[int]:
        """The S3 codes among a reply's ids."""
        return [i - AUDIO_OFFSET for i in ids if AUDIO_OFFSET <= i < AUDIO_OFFSET + AUDIO_CODES]

    def reply_text(self, ids: list[int]) -> str:
        """The text among a reply's ids (control and audio ids left out)."""
        first_control = self.template.text.first_added_id
        return self.template.text.decode([i for i in ids if i < first_control])
