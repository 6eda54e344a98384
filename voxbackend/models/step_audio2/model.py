"""Step-Audio 2 mini: a Qwen2.5-7B-shaped LM that hears audio (the audio encoder's rows at the prompt's
placeholder rows) and answers with text ids interleaved with audio ids (S3 codes from AUDIO_OFFSET), ending at
`<|EOT|>`; the audio ids are spoken by its token2wav (codec.py) in a stored voice.

`StepAudio2Frontend` (the preprocess) holds no weights: the chat template, the voices, and the clips cut into 25 s
pieces and turned into spectrograms. `StepAudio2` adds the audio encoder, which runs in the engine on its device, in
one batch for the requests admitted together (engine_features), the LM and the codec. The reply's text goes out as
TEXT events in order with its audio (TEXT_OUT through Triton).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from voxbackend.audio_io import read_audio
from voxbackend.errors import InvalidRequest
from voxbackend.components.flow_hift.dit_token2wav import VoicePrompt
from voxbackend.models.base import ModelSpec, Prompt, PromptFeatures, SpeechModel, WindowJob, WindowSpec
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.conversation import (HISTORY_INPUTS, INPUT_AUDIO, MAX_AUDIO_S, MAX_CLIP_S, HistoryTurn,
                                            check_history, history_turn)
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.step_audio2.audio_encoder import SAMPLE_RATE, load_audio_encoder, placeholder_count
from voxbackend.models.step_audio2.chat import ChatTemplate, Turn
from voxbackend.models.step_audio2.codec import (DEFAULT_VOICE, ReplyAudio, codec_config, load_codec, load_voice,
                                                  voice_names)
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

AUDIO_OFFSET = 151696  # the first audio id: S3 code 0 of CosyVoice2's 6561-code tokenizer
AUDIO_CODES = 6561
N_MELS = 128
MIN_PIECE_FRAMES = 3  # the 2 tail-pad frames and one of audio: 1 placeholder row
ENCODER_BATCH = 16  # audio pieces (up to 25 s each) per encoder call
MAX_TOKENS = 4096  # upstream's cap for a spoken reply


def is_step_audio2_config(hf_config: dict) -> bool:
    """The official config.json nests the LM's and the audio encoder's settings."""
    return "text_config" in hf_config and "audio_encoder_config" in hf_config


class StepAudio2Frontend(SpeechModel):
    """What the preprocess needs: the chat template, the voices, the spectrograms of the clips; no weights."""

    request_inputs = (
        INPUT_AUDIO,
        TensorSpec("VOICE", "STRING", optional=True, arg="voice",
                   doc="the voice the reply is spoken in (a voices/ file of the checkpoint); default: \"default\""),
        TensorSpec("SPEAK", "BOOL", optional=True, arg="speak", doc="false: a text reply only, no audio; default true"),
        TensorSpec("SYSTEM_PROMPT", "STRING", optional=True, arg="system", doc="the system prompt (none if absent)"),
        *HISTORY_INPUTS,
    )
    # the prompt's clips as spectrograms, for the audio encoder in the engine (engine_features)
    conditioning = (
        TensorSpec("AUDIO_MELS", "FP32", (N_MELS, -1), optional=True, arg="audio_mels",
                   doc="the log-mel spectrograms of the prompt's audio pieces, one after another in time"),
        TensorSpec("AUDIO_MEL_FRAMES", "INT32", (-1,), optional=True, arg="audio_mel_frames",
                   doc="each piece's frames in AUDIO_MELS, in prompt order"),
        # the voice a spoken reply is in (codec.py); a text reply has none
        TensorSpec("PROMPT_SPEECH_TOKENS", "INT32", (-1,), optional=True, arg="prompt_speech_tokens",
                   doc="the voice's 25 Hz speech tokens (flow prompt)"),
        TensorSpec("PROMPT_FEAT", "FP32", (-1, 80), optional=True, arg="prompt_feat",
                   doc="the voice's 50 Hz mel, 2 frames a token"),
        TensorSpec("SPEAKER_EMBEDDING", "FP32", (-1,), optional=True, arg="speaker_embedding",
                   doc="the voice's speaker vector"),
    )
    engine_features = True
    text_required = False  # TEXT, INPUT_AUDIO or both: the user's turn
    codec_stage = False  # ReplyAudio holds the request's streaming flow decoder (modules and caches), not wire data

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None):
        model_dir = Path(model_dir)
        self.hf_config = read_config(model_dir)
        if not is_step_audio2_config(self.hf_config):
            raise ValueError(f"{model_dir}/config.json has no text_config and audio_encoder_config: not Step-Audio 2")
        self.cfg = DecoderConfig.from_hf(self.hf_config["text_config"], family="qwen2")
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self.template = ChatTemplate(Tokenizer.from_file(str(tokenizer_file)))
        self.model_dir = model_dir
        self.voices = voice_names(model_dir)
        if DEFAULT_VOICE not in self.voices:
            raise FileNotFoundError(f"no voices/{DEFAULT_VOICE}.safetensors in {model_dir}: the voice replies are "
                                    "spoken in by default")
        codec = codec_config(model_dir)
        self.stream = codec.stream
        chunk = self.stream.chunk_tokens + self.stream.lookahead_tokens  # nominal: the state schedules the chunks
        self.spec = ModelSpec(name="step_audio2", geometry=self.cfg.geometry(), sample_rate=codec.hift.sampling_rate,
                              codes_per_frame=1, stop_ids=(self.template.eot,), max_tokens=MAX_TOKENS,
                              window=WindowSpec(frames=chunk, hop_frames=self.stream.chunk_tokens, first_frames=chunk,
                                                flush_on_finish=True, stateful=True, scheduled_by_model=True))

    def prepare(self, text: str | None = None, voice: str | None = None, *, audio=None, sample_rate: int | None = None,
                system: str | None = None, history: list[dict] | None = None, speak: bool = True) -> Prompt:
        """The user's turn (text, a clip, or both) after an optional system prompt and earlier turns; the
        assistant's turn is opened for a spoken reply (`speak`) or a text one. `audio`: file bytes, or float samples
        at `sample_rate`. `history`: [{"role": "user" | "assistant", "text": ..., "audio": ..., "sample_rate": ...}],
        oldest first; an assistant turn is given by its text (what it said)."""
        turns = [Turn("system", self.check_text(system, "system"))] if system is not None else []
        history = check_history(history)
        for i, turn in enumerate(history):
            turns.append(self._history_turn(history_turn(turn, f"history[{i}]"), f"history[{i}]"))
        turns.append(Turn("user", self._user_content(text, audio, sample_rate, "text", "audio")))
        turns.append(Turn("assistant", [[self.template.tts_start]] if speak else [], ends=False))
        chat = self.template.render(turns)
        clips_s = sum(m.shape[-1] for m in chat.mels) * 160 / SAMPLE_RATE
        if clips_s > MAX_AUDIO_S:
            raise InvalidRequest(f"the request's audio is {clips_s:.0f} s in all; the limit is {MAX_AUDIO_S:.0f} s",
                                 field="history" if history else "audio")
        if len(chat.ids) >= self.spec.geometry.max_context:
            raise InvalidRequest(f"prompt is {len(chat.ids)} tokens; the model's context is "
                                 f"{self.spec.geometry.max_context}", field="history" if history else "text")
        conditioning = self._voice(voice) if speak else {}
        if chat.mels:
            conditioning["audio_mels"] = torch.cat(chat.mels, dim=1).numpy()
            conditioning["audio_mel_frames"] = np.array([m.shape[-1] for m in chat.mels], np.int32)
        return Prompt(chat.ids, conditioning)

    def _voice(self, voice: str | None) -> dict[str, np.ndarray]:
        name = voice or DEFAULT_VOICE
        if name not in self.voices:
            raise InvalidRequest(f"unknown voice {name!r}; choose one of {', '.join(self.voices)}", field="voice")
        return load_voice(self.model_dir, name)

    def _user_content(self, text, audio, sample_rate, text_field: str, audio_field: str) -> list:
        content: list = []
        if text is not None and text != "":
            content.append(self.check_text(text, text_field))
        if audio is not None:
            content.append(read_audio(audio, sample_rate, SAMPLE_RATE, max_seconds=MAX_CLIP_S, field=audio_field))
        if not content:
            raise InvalidRequest(f"give {text_field}, {audio_field} or both", field=text_field)
        return content

    def _history_turn(self, turn: HistoryTurn, field: str) -> Turn:
        if turn.role == "user":
            return Turn("user", self._user_content(turn.text, turn.audio, turn.sample_rate, f"{field}.text",
                                                   f"{field}.audio"))
        return Turn("assistant", self.check_text(turn.text, f"{field}.text"))

    def feature_count(self, conditioning: dict[str, np.ndarray]) -> int:
        frames = conditioning.get("audio_mel_frames")
        mels = conditioning.get("audio_mels")
        if frames is None and mels is None:
            return 0
        if frames is None or mels is None or frames.sum() != mels.shape[1] or (frames < MIN_PIECE_FRAMES).any():
            raise InvalidRequest("AUDIO_MEL_FRAMES must give each piece's frames (at least "
                                 f"{MIN_PIECE_FRAMES}) in AUDIO_MELS", field="audio_mel_frames")
        return sum(placeholder_count(int(f)) for f in frames)

    def default_sampling(self) -> SamplingParams:
        # upstream's examples: temperature 0.7, top_p 0.9, repetition_penalty 1.05; top_k 50 is transformers'
        # GenerationConfig default in the 4.x releases it was written for (its generate call leaves it in place)
        return SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.05, max_tokens=MAX_TOKENS)

    # --- the reply: text ids (said as TEXT events) and audio ids (S3 codes for the codec), interleaved ---
    text_output = True

    def is_text_id(self, step: int) -> bool:
        return step < self.template.text.first_added_id  # control ids (<|EOT|>, <tts_start>, ...) and audio ids not

    def decode_text(self, ids: list[int]) -> str:
        return self.template.text.decode(ids)

    def codes_from_step(self, step: int, codes_so_far: int) -> list[int]:
        return [step - AUDIO_OFFSET] if AUDIO_OFFSET <= step < AUDIO_OFFSET + AUDIO_CODES else []


class StepAudio2(StepAudio2Frontend):
    """The audio encoder, the LM and the codec (token2wav), on `device`; lm=False: without the LM (a codec stage)."""

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        super().__init__(model_dir, codec_dir)
        self.codec = load_codec(self.model_dir, device, dtype)
        weights = load_safetensors(self.model_dir)
        self.audio_encoder = load_audio_encoder(self.hf_config, weights, device, dtype)
        if lm:
            self.backbone = build_decoder(self.cfg, weights, device, dtype)

    @torch.inference_mode()
    def encode_features(self, conditionings: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Every piece of every request through the audio encoder, ENCODER_BATCH pieces a call."""
        pieces: list[torch.Tensor] = []
        counts: list[int] = []  # pieces per request
        for cond in conditionings:
            frames = [int(f) for f in cond.get("audio_mel_frames", ())]
            if frames:
                pieces += torch.split(torch.from_numpy(np.asarray(cond["audio_mels"], np.float32)), frames, dim=1)
            counts.append(len(frames))
        rows: list[torch.Tensor] = []
        for k in range(0, len(pieces), ENCODER_BATCH):
            rows += self.audio_encoder(pieces[k:k + ENCODER_BATCH])
        out, k = [], 0
        for n in counts:
            out.append(torch.cat(rows[k:k + n]) if n else torch.zeros(0, self.cfg.hidden_size))
            k += n
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                features: PromptFeatures | None = None) -> torch.Tensor:
        x = self.backbone.embed(input_ids.clamp(min=0))  # FEATURE rows (negative ids) get their vectors below
        if features is not None:
            x = x.index_copy(0, features.rows, features.vectors.to(x.dtype))
        return self.backbone.forward_embeds(x, positions, attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backbone.logits(hidden)

    # --- speech out (codec.py): the reply's audio ids, spoken in the request's voice ---
    def new_codec_state(self, conditioning: dict[str, np.ndarray]) -> ReplyAudio | None:
        if "prompt_speech_tokens" not in conditioning:  # a text reply: no voice
            return None
        return ReplyAudio(VoicePrompt(torch.as_tensor(conditioning["prompt_speech_tokens"], dtype=torch.long),
                                      torch.as_tensor(conditioning["prompt_feat"]),
                                      torch.as_tensor(conditioning["speaker_embedding"])))

    def windows_ready(self, state: ReplyAudio | None, codes: list[int], lm_done: bool) -> int:
        if state is None:
            return 0
        state.codes.extend(codes[len(state.codes):])
        state.ended = lm_done
        stream = self.codec.cfg
        return 1 if state.window(stream.chunk_tokens, stream.lookahead_tokens) else 0

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        """One chunk per request (stateful windows go one at a time); the first starts the request's decoder, its
        flow noise and HiFT excitation drawn from the window's seed. The step's audio comes to the host in one copy."""
        stream, out = self.codec.cfg, []
        for job in jobs:
            state: ReplyAudio = job.state
            start, end, last = state.window(stream.chunk_tokens, stream.lookahead_tokens)
            if state.decoder is None:
                state.decoder = self.codec.start(state.prompt, torch.Generator().manual_seed(job.seed), job.seed)
            audio = self.codec.decode_chunk(state.decoder, state.codes[start:end], last_chunk=last)
            state.spoken = end if last else start + stream.chunk_tokens
            out.append(audio)
        host = torch.cat(out).cpu().numpy() if out else np.zeros(0, np.float32)
        cuts = np.cumsum([a.numel() for a in out])[:-1]
        return [part.astype(np.float32, copy=False) for part in np.split(host, cuts)]
