"""GLM-4-Voice-9B: a GLM-4 LM that hears the user's speech as discrete tokens (its speech tokenizer, 12.5 a second)
and answers with text ids and speech ids interleaved (13 and 26 in turn, as it was trained), ending by opening the
next user turn; the speech ids are spoken by its flow-matching + HiFT decoder at 22.05 kHz in its one voice.

The checkpoint folder is glm-4-voice-9b's (config.json of `model_type: chatglm`, the LM's safetensors, GLM-4's
tokenizer.model and tokenizer_config.json) holding the other two official folders: `glm-4-voice-tokenizer/` (the
speech tokenizer) and `glm-4-voice-decoder/` (the speech decoder; `codec_dir` may point elsewhere).

`GLM4VoiceFrontend` (the preprocess) holds no weights: the chat template and the clips, resampled to 16 kHz.
`GLM4Voice` adds the speech tokenizer, which runs in the engine on its device in one batch for the requests admitted
together (engine_features: its ids' embeddings fill the prompt's FEATURE rows, as the ids themselves would), the
LM and the decoder. The reply's text goes out as TEXT events in order with its audio.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from voxbackend.audio_io import read_audio
from voxbackend.errors import InvalidRequest
from voxbackend.models.base import ModelSpec, Prompt, PromptFeatures, SpeechModel, WindowJob, WindowSpec
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.conversation import (HISTORY_INPUTS, INPUT_AUDIO, MAX_AUDIO_S, MAX_CLIP_S, HistoryTurn,
                                            check_history, history_turn)
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.glm4_voice.chat import (SPEECH_CODES, SPEECH_SYSTEM, TEXT_SYSTEM, ChatTemplate, GlmTokenizer,
                                               Turn)
from voxbackend.models.glm4_voice.codec import DecodeState, decoder_config, load_decoder
from voxbackend.models.glm4_voice.speech_tokenizer import (SAMPLE_RATE, TokenizerConfig, load_speech_tokenizer,
                                                           token_count)
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

TOKENIZER_FOLDER = "glm-4-voice-tokenizer"
DECODER_FOLDER = "glm-4-voice-decoder"
DEFAULT_VOICE = "default"  # the decoder speaks in one voice
MAX_TOKENS = 2000  # upstream's demo cap on a reply


def is_glm4_voice_folder(folder: Path) -> bool:
    """glm-4-voice-9b's folder (a chatglm config) with the speech tokenizer's folder inside."""
    config = folder / "config.json"
    return (config.is_file() and (folder / TOKENIZER_FOLDER / "config.json").is_file()
            and read_config(folder).get("model_type") == "chatglm")


def find_decoder(model_dir: Path, codec_dir: str | Path | None) -> Path:
    return Path(codec_dir) if codec_dir else Path(model_dir) / DECODER_FOLDER


class GLM4VoiceFrontend(SpeechModel):
    """What the preprocess needs: the chat template and the clips (16 kHz samples); no weights."""

    request_inputs = (
        INPUT_AUDIO,
        TensorSpec("VOICE", "STRING", optional=True, arg="voice", doc='the reply\'s voice: only "default" (the '
                   "decoder has one)"),
        TensorSpec("SPEAK", "BOOL", optional=True, arg="speak",
                   doc="false: the reply's text only (its speech ids are not decoded); default true"),
        TensorSpec("SYSTEM_PROMPT", "STRING", optional=True, arg="system",
                   doc="the system prompt; default: upstream's, which asks for the 13 text / 26 speech interleave"),
        *HISTORY_INPUTS,
    )
    # the prompt's clips, for the speech tokenizer in the engine (engine_features)
    conditioning = (
        TensorSpec("AUDIO_SAMPLES", "FP32", (-1,), optional=True, arg="audio_samples",
                   doc="the prompt's clips at 16 kHz, one after another"),
        TensorSpec("AUDIO_CLIP_SAMPLES", "INT32", (-1,), optional=True, arg="audio_clip_samples",
                   doc="each clip's samples in AUDIO_SAMPLES, in prompt order"),
        TensorSpec("SPEAK_REPLY", "INT32", (1,), optional=True, arg="speak_reply",
                   doc="0: the reply's speech ids are not decoded (SPEAK false); 1 or absent: they are"),
    )
    voices = (DEFAULT_VOICE,)
    engine_features = True
    text_required = False  # TEXT, INPUT_AUDIO or both: the user's turn
    text_output = True
    codec_stage = False  # the decoder's per-request state holds the reply's mels and HiFT caches

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None):
        model_dir = Path(model_dir)
        if not is_glm4_voice_folder(model_dir):
            raise ValueError(f"{model_dir} is not a GLM-4-Voice folder (a chatglm config.json and "
                             f"{TOKENIZER_FOLDER}/ inside)")
        self.model_dir = model_dir
        self.hf_config = read_config(model_dir)
        self.cfg = DecoderConfig.from_hf(self.hf_config)
        self.template = ChatTemplate(GlmTokenizer(model_dir))
        self.token_samples = TokenizerConfig.from_hf(read_config(model_dir / TOKENIZER_FOLDER)).token_samples
        self.decoder_dir = find_decoder(model_dir, codec_dir)
        codec = decoder_config(self.decoder_dir)
        self.spec = ModelSpec(name="glm4_voice", geometry=self.cfg.geometry(), sample_rate=codec.sample_rate,
                              codes_per_frame=1, stop_ids=self.template.stop_ids, max_tokens=MAX_TOKENS,
                              window=WindowSpec(frames=codec.first_block, hop_frames=codec.first_block,
                                                first_frames=codec.first_block, flush_on_finish=True, stateful=True,
                                                scheduled_by_model=True))

    def prepare(self, text: str | None = None, voice: str | None = None, *, audio=None, sample_rate: int | None = None,
                system: str | None = None, history: list[dict] | None = None, speak: bool = True) -> Prompt:
        """The user's turn (text, a clip, or both) after a system prompt (default: upstream's for the turn's kind)
        and earlier turns; the assistant's turn opened. `audio`: file bytes, or float samples at `sample_rate`.
        `history`: [{"role": "user" | "assistant", "text": ..., "audio": ..., "sample_rate": ...}], oldest first; an
        assistant turn is given by its text (what it said). `speak`: False leaves the reply's speech undecoded."""
        if voice not in (None, "", DEFAULT_VOICE):
            raise InvalidRequest(f"unknown voice {voice!r}; choose one of {DEFAULT_VOICE}", field="voice")
        history = check_history(history)
        clips: list[np.ndarray] = []
        turns = [self._history_turn(history_turn(turn, f"history[{i}]"), f"history[{i}]", clips)
                 for i, turn in enumerate(history)]
        user = self._user_turn(text, audio, sample_rate, "text", "audio", clips)
        if system is None:
            system = SPEECH_SYSTEM if user.speech_tokens else TEXT_SYSTEM
        turns = [Turn("system", self.check_text(system, "system", allow_blank=True)), *turns, user]
        seconds = sum(c.size for c in clips) / SAMPLE_RATE
        if seconds > MAX_AUDIO_S:
            raise InvalidRequest(f"the request's audio is {seconds:.0f} s in all; the limit is {MAX_AUDIO_S:.0f} s",
                                 field="history" if history else "audio")
        ids = self.template.render(turns)
        if len(ids) >= self.spec.geometry.max_context:
            raise InvalidRequest(f"prompt is {len(ids)} tokens; the model's context is "
                                 f"{self.spec.geometry.max_context}", field="history" if history else "text")
        conditioning: dict[str, np.ndarray] = {"speak_reply": np.array([int(bool(speak))], np.int32)}
        if clips:
            conditioning["audio_samples"] = np.concatenate(clips).astype(np.float32)
            conditioning["audio_clip_samples"] = np.array([c.size for c in clips], np.int32)
        return Prompt(ids, conditioning)

    def _user_turn(self, text, audio, sample_rate, text_field: str, audio_field: str, clips: list) -> Turn:
        text = self.check_text(text, text_field) if text is not None and text != "" else None
        tokens = 0
        if audio is not None:
            clip = read_audio(audio, sample_rate, SAMPLE_RATE, max_seconds=MAX_CLIP_S, field=audio_field)
            clips.append(clip)
            tokens = token_count(clip.size, self.token_samples)
        if text is None and not tokens:
            raise InvalidRequest(f"give {text_field}, {audio_field} or both", field=text_field)
        return Turn("user", text, tokens)

    def _history_turn(self, turn: HistoryTurn, field: str, clips: list) -> Turn:
        if turn.role == "user":
            return self._user_turn(turn.text, turn.audio, turn.sample_rate, f"{field}.text", f"{field}.audio", clips)
        return Turn("assistant", self.check_text(turn.text, f"{field}.text"))

    def feature_count(self, conditioning: dict[str, np.ndarray]) -> int:
        lengths, samples = conditioning.get("audio_clip_samples"), conditioning.get("audio_samples")
        if lengths is None and samples is None:
            return 0
        if lengths is None or samples is None or lengths.sum() != samples.size or (lengths < 1).any():
            raise InvalidRequest("AUDIO_CLIP_SAMPLES must give each clip's samples (at least 1) in AUDIO_SAMPLES",
                                 field="audio_clip_samples")
        return sum(token_count(int(n), self.token_samples) for n in lengths)

    def default_sampling(self) -> SamplingParams:
        # upstream's demo: temperature 0.2, top_p 0.8; top_k 50 is transformers' GenerationConfig default in the 4.x
        # releases it was written for (its generate call leaves it in place)
        return SamplingParams(temperature=0.2, top_p=0.8, top_k=50, max_tokens=MAX_TOKENS)

    # --- the reply: text ids (said as TEXT events) and speech ids (the decoder's codes), interleaved ---
    def is_text_id(self, step: int) -> bool:
        return step < self.template.text.first_added_id

    def decode_text(self, ids: list[int]) -> str:
        return self.template.text.decode(ids)

    def codes_from_step(self, step: int, codes_so_far: int) -> list[int]:
        offset = self.template.audio_offset
        return [step - offset] if offset <= step < offset + SPEECH_CODES else []


class GLM4Voice(GLM4VoiceFrontend):
    """The speech tokenizer, the LM and the speech decoder, on `device`."""

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        super().__init__(model_dir, codec_dir)
        self.codec = load_decoder(self.decoder_dir, device, dtype)
        # float32 as upstream runs it: another dtype moves ids that sit near a tie between codewords
        self.speech_tokenizer = load_speech_tokenizer(self.model_dir / TOKENIZER_FOLDER, device, torch.float32)
        if lm:
            self.backbone = build_decoder(self.cfg, load_safetensors(self.model_dir), device, dtype)

    @torch.inference_mode()
    def encode_features(self, conditionings: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Every clip of every request through the speech tokenizer at once; each request's rows are the LM's
        embeddings of its clips' speech ids."""
        clips: list[np.ndarray] = []
        counts: list[int] = []  # clips per request
        for cond in conditionings:
            lengths = [int(n) for n in cond.get("audio_clip_samples", ())]
            if lengths:
                clips += np.split(np.asarray(cond["audio_samples"], np.float32), np.cumsum(lengths)[:-1])
            counts.append(len(lengths))
        tokens = self.speech_tokenizer.speech_tokens(clips) if clips else []
        device = self.backbone.embed.weight.device
        out, k = [], 0
        for n in counts:
            ids = [t + self.template.audio_offset for clip in tokens[k:k + n] for t in clip]
            out.append(self.backbone.embed(torch.tensor(ids, dtype=torch.long, device=device)))
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

    # --- speech out (codec.py): the reply's speech ids, block by block as upstream's server cuts them ---
    def new_codec_state(self, conditioning: dict[str, np.ndarray]) -> DecodeState | None:
        speak = conditioning.get("speak_reply")
        if speak is not None and not int(np.asarray(speak).reshape(-1)[0]):
            return None  # a text reply: the speech ids are not decoded
        return self.codec.new_state()

    def windows_ready(self, state: DecodeState | None, codes: list[int], lm_done: bool) -> int:
        if state is None:
            return 0
        if not state.ended:
            state.push(codes[len(state.tokens):])
            if lm_done:
                state.end()
        return 1 if self.codec.next_block(state) is not None else 0

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        """The due block of each request, in one batch; a request's first block seeds its decoder's noise."""
        states: list[DecodeState] = [job.state for job in jobs]
        for job, state in zip(jobs, states):
            if state.blocks == 0:
                state.seed = job.seed
        audio = self.codec.decode(states, [self.codec.next_block(s) for s in states])
        return [a.numpy().astype(np.float32, copy=False) for a in audio]
