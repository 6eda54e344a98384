"""Qwen3-TTS-12Hz preprocessing: tokenizer, prompt rules, the dual text track and the spec, without talker weights.

Follows the reference `Qwen3TTSForConditionalGeneration.generate(non_streaming_mode=False)` (qwen-tts) row by row.
A row is [codebook 0 .. codebook 15, text id] (-1: absent); the prompt is
  * VoiceDesign / CustomVoice instruct: `<|im_start|>user\\n{instruct}<|im_end|>\\n`, text-only rows;
  * the role `<|im_start|>assistant\\n`, text-only rows;
  * the codec prefix in codebook 0: nothink, think_bos, think_eos (language auto) or think, think_bos, language,
    think_eos; the speaker id (CustomVoice); pad. Each carries tts_pad in the text column, the last one (pad)
    tts_bos;
  * codec bos + the first text token.
Base (voice cloning, the reference's in-context mode) puts a FEATURE row (the x-vector speaker embedding, with
tts_pad) where CustomVoice has the speaker id, and replaces the last row by the in-context rows: codec bos, then
the reference clip's codes (all 16 codebooks), summed with the text of the reference transcript + the target
text + tts_eos; text beyond those rows rides on the dual track, and shorter text is padded with tts_pad (its
tts_eos then is in the prompt already).
The remaining text tokens are not positions: each rides on the talker input that follows a generated frame, then
tts_eos, then tts_pad for as long as the talker speaks. They travel in the prompt as QUEUED rows, which
`split_prompt` turns into the request's `TextTrack`; `next_input` takes one id per step. An open track (text
streaming) that has run out of ids makes the request wait for `Engine.append_text`.

The text ids are exactly the reference's: it tokenizes `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>
assistant\\n` whole and slices it ([:3] role, [3] first token, [4:-5] the track); the control tokens split the
string into the same segments that are encoded here one by one, user text through TextTokenizer (never a control
token).
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from voxbackend.errors import InvalidRequest
from voxbackend.models.base import FEATURE, QUEUED, ModelSpec, Prompt, SpeechModel, WindowSpec
from voxbackend.models.checkpoint import read_config
from voxbackend.models.qwen3_tts.talker import talker_decoder_config
from voxbackend.models.text_tokens import TextTokenizer
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

MAX_NEW_TOKENS = 2048  # qwen_tts' hard default when the checkpoint's generation_config.json does not say
MIN_NEW_TOKENS = 2  # the reference's min_new_tokens: no EOS in the first two frames
SPEECH_TOKENIZER = "speech_tokenizer"
# Windows of the stateful (exactly streaming) codec: the first frame decodes as soon as it exists (80 ms of audio
# one talker step after the prefill); then 4 frames (320 ms) per call, which amortizes the codec's fixed cost per
# call while a stream stays far ahead of real time.
FIRST_WINDOW_FRAMES = 1
WINDOW_FRAMES = 4
VARIANTS = ("custom_voice", "voice_design", "base")
CACHED_CLIPS = 64  # Base: reference clips whose codes and x-vector are kept (a service clones a few voices often)


def is_qwen3_tts_config(hf_config: dict) -> bool:
    archs = hf_config.get("architectures") or ()
    return "Qwen3TTSForConditionalGeneration" in archs or hf_config.get("model_type") == "qwen3_tts" or (
        "talker_config" in hf_config and "code_predictor_config" in (hf_config.get("talker_config") or {}))


def find_speech_tokenizer(model_dir: Path, codec_dir: str | Path | None) -> Path:
    """The codec is the checkpoint's `speech_tokenizer/` folder unless codec_dir says otherwise."""
    return Path(codec_dir) if codec_dir else Path(model_dir) / SPEECH_TOKENIZER


@dataclass
class TextTrack:
    """One request's dual-track text: ids still to ride along, whether more may come, and whether tts_eos went."""

    pending: deque = field(default_factory=deque)
    open: bool = False
    eos_sent: bool = False


def load_qwen_tokenizer(model_dir: Path) -> Tokenizer:
    """tokenizer.json, or (the official release ships vocab.json + merges.txt) transformers' Qwen2 fast tokenizer,
    whose backend is the same `tokenizers` object the reference's processor uses."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer
    raise FileNotFoundError(f"no tokenizer.json (or vocab.json + merges.txt) in {model_dir}")


class Qwen3TTSFrontend(SpeechModel):
    """What preprocessing needs (prompt rows, request inputs, spec, default sampling): no talker or codec weights."""

    text_streaming = True
    # one Triton schema for every variant: what a checkpoint does not take is refused by prepare, naming the field
    request_inputs = (
        TensorSpec("VOICE", "STRING", optional=True,
                   doc="CustomVoice speaker from the checkpoint's spk_id (case-insensitive); its first speaker when "
                       "absent; refused by VoiceDesign and Base checkpoints", arg="voice"),
        TensorSpec("LANGUAGE", "STRING", optional=True,
                   doc="auto (default) or a language of the checkpoint's codec_language_id, e.g. english",
                   arg="language"),
        TensorSpec("INSTRUCT", "STRING", optional=True,
                   doc="voice / style instruction (VoiceDesign; CustomVoice 1.7B); refused by 0.6B CustomVoice "
                       "and Base", arg="instruct"),
        TensorSpec("REFERENCE_AUDIO", "STRING", optional=True, arg="reference_audio", kind="audio",
                   doc="Base (voice cloning): the voice to clone, a WAV/FLAC/OGG clip of 80 ms to 30 s (any rate), "
                       "with REFERENCE_TEXT; refused by CustomVoice and VoiceDesign"),
        TensorSpec("REFERENCE_TEXT", "STRING", optional=True, arg="reference_text",
                   doc="Base: the transcript of REFERENCE_AUDIO"),
    )
    # Base (voice cloning): the reference clip's speaker embedding (the prompt's FEATURE row) and codes (the
    # in-context rows, and what the codec state is primed with)
    conditioning = (
        TensorSpec("X_VECTOR", "FP32", (-1,), optional=True, arg="x_vector",
                   doc="Base: the reference clip's speaker embedding (talker width)"),
        TensorSpec("REFERENCE_CODES", "INT32", (-1, -1), optional=True, arg="reference_codes",
                   doc="Base: the reference clip's 12 Hz codes [frames, 16]"),
    )

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None):
        model_dir = Path(model_dir)
        hf = read_config(model_dir)
        self.variant = hf.get("tts_model_type")
        if self.variant not in VARIANTS:
            raise ValueError(f"{model_dir}: tts_model_type {self.variant!r} is not one of {VARIANTS}")
        if hf.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise ValueError(f"{model_dir}: tokenizer_type {hf.get('tokenizer_type')!r}; only the 12 Hz "
                             "tokenizer (qwen3_tts_tokenizer_12hz) is supported")
        talker = hf["talker_config"]
        self.groups: int = talker["num_code_groups"]
        self.codec_vocab: int = talker["vocab_size"]
        self.eos: int = talker["codec_eos_token_id"]
        self.codec_ids = {k: talker[f"codec_{k}_id"] for k in ("think", "nothink", "think_bos", "think_eos", "pad",
                                                                 "bos")}
        self.speakers: dict[str, int] = {k.lower(): v for k, v in (talker.get("spk_id") or {}).items()}
        self.dialects: dict[str, str | bool] = {k.lower(): v for k, v in (talker.get("spk_is_dialect") or {}).items()}
        self.languages: dict[str, int] = {k.lower(): v for k, v in (talker.get("codec_language_id") or {}).items()}
        bad = {k: v for k, v in {**self.codec_ids, **self.speakers, **self.languages}.items()
               if not 0 <= v < self.codec_vocab}
        if bad:
            raise ValueError(f"talker_config codec ids outside the codec vocabulary ({self.codec_vocab}): {bad}")
        self.voices = tuple(self.speakers) if self.variant == "custom_voice" else ()
        # the reference drops instruct on 0.6B CustomVoice checkpoints (tts_model_size "0b6") and Base ones; here it
        # is refused
        self.takes_instruct = self.variant == "voice_design" or (
            self.variant == "custom_voice" and (hf.get("tts_model_size") or "") not in ("0b6", ""))
        self.clones = self.variant == "base"
        self.model_dir, self.speech_dir = model_dir, find_speech_tokenizer(model_dir, codec_dir)
        self._voice_clone = None  # Base: the reference-clip encoders, loaded with the first clip
        self._voice_clone_lock = threading.Lock()
        self._clips: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # clip digest -> encoded
        self.clips_encoded = 0  # clips run through the encoders (tells a cache hit from a recompute)
        self.code_size: int = talker["code_predictor_config"]["vocab_size"]
        self.tts_pad, self.tts_bos, self.tts_eos = (hf.get(k, d) for k, d in (
            ("tts_pad_token_id", 151671), ("tts_bos_token_id", 151672), ("tts_eos_token_id", 151673)))
        self.im_start, self.im_end = hf.get("im_start_token_id", 151644), hf.get("im_end_token_id", 151645)
        self.text_vocab: int = talker["text_vocab_size"]
        self.tokenizer = load_qwen_tokenizer(model_dir)
        self.text_tokenizer = TextTokenizer(self.tokenizer)  # user text never becomes a control token
        self.generation = self._generation_config(model_dir)

        codec_cfg = json.loads((find_speech_tokenizer(model_dir, codec_dir) / "config.json").read_text())
        self.cfg = talker_decoder_config(talker)
        self.spec = ModelSpec(
            name="qwen3_tts",
            geometry=self.cfg.geometry(),
            sample_rate=codec_cfg.get("output_sample_rate", 24000),
            codes_per_frame=self.groups,
            window=WindowSpec(frames=WINDOW_FRAMES, hop_frames=WINDOW_FRAMES, first_frames=FIRST_WINDOW_FRAMES,
                              flush_on_finish=True, stateful=True),
            stop_ids=(),
            token_columns=self.groups + 1,
            has_depth=True,
            column_vocab=(self.codec_vocab,) + (talker["code_predictor_config"]["vocab_size"],) * (self.groups - 1)
            + (self.text_vocab,),
            max_tokens=int(self.generation.get("max_new_tokens", MAX_NEW_TOKENS)),
            # HF generate from inputs_embeds: the penalty sees the generated codebook-0 ids only (the prompt has no
            # input ids) and the code predictor's generate applies none
            penalty_columns=(0,),
            penalty_on_prompt=False,
        )

    @property
    def supported_languages(self) -> tuple[str, ...]:
        return ("auto",) + tuple(k for k in self.languages if "dialect" not in k)

    @staticmethod
    def _generation_config(model_dir: Path) -> dict:
        path = model_dir / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def default_sampling(self) -> SamplingParams:
        g = self.generation
        return SamplingParams(
            temperature=float(g.get("temperature", 0.9)) if g.get("do_sample", True) else 0.0,
            top_k=int(g.get("top_k", 50)), top_p=float(g.get("top_p", 1.0)),
            repetition_penalty=float(g.get("repetition_penalty", 1.05)), max_tokens=self.spec.max_tokens,
        )

    # ---------------------------------------------------------------- prompt
    def prepare(self, text: str, voice: str | None = None, *, text_open: bool = False, language: str | None = None,
                instruct: str | None = None, reference_audio: bytes | np.ndarray | None = None,
                reference_text: str | None = None, reference_codes: np.ndarray | None = None,
                x_vector: np.ndarray | None = None) -> list[list[int]] | Prompt:
        """Base checkpoints need the reference: its transcript and either the clip (`reference_audio`: file bytes,
        or float samples at 24 kHz) or what the encoders make of it (codes [T, 16] and x-vector [hidden])."""
        text = self._text(text, "text")
        reference = self._reference(reference_audio, reference_text, reference_codes, x_vector, text_open)
        speaker = self._speaker(voice)
        language_id = self._language_id(language, speaker)
        rows = []
        if instruct is not None and not isinstance(instruct, str):
            raise InvalidRequest(f"instruct must be a string, got {type(instruct).__name__}", field="instruct")
        if instruct:
            if not self.takes_instruct:
                raise InvalidRequest(f"instruct is not taken by this checkpoint (Qwen3-TTS "
                                     f"{'Base' if self.clones else '0.6B CustomVoice'})", field="instruct")
            instruct = self._text(instruct, "instruct")
            ids = [self.im_start, *self.encode("user\n" + instruct), self.im_end, *self.encode("\n")]
            rows += [self._text_row(t) for t in ids]
        spoken = [self.im_start, *self.encode("assistant\n" + text)]
        if len(spoken) < 4:
            raise InvalidRequest("text has no tokens", field="text")
        if text_open:
            track = spoken[4:]
        else:  # the reference's input_id[4:-5] of the whole template
            track = (spoken + [self.im_end, *self.encode("\n"), self.im_start, *self.encode("assistant\n")])[4:-5]
        rows += [self._text_row(t) for t in spoken[:3]]
        c = self.codec_ids
        codec = [c["nothink"], c["think_bos"], c["think_eos"]] if language_id is None else \
            [c["think"], c["think_bos"], language_id, c["think_eos"]]
        codec += ([self.speakers[speaker]] if speaker else []) + ([FEATURE] if reference else []) + [c["pad"]]
        rows += [self._codec_row(cid, self.tts_pad) for cid in codec[:-1]]
        rows.append(self._codec_row(codec[-1], self.tts_bos))
        if reference:
            rows += self._in_context_rows(reference[0], reference[1], spoken[3:])  # input_id[3:-5]
        else:
            rows.append(self._codec_row(c["bos"], spoken[3]))
            rows += [self._codec_row(QUEUED, t) for t in track]
        if len(rows) >= self.spec.geometry.max_context:
            raise InvalidRequest(f"prompt is {len(rows)} positions; the model's context is "
                                 f"{self.spec.geometry.max_context}", field="reference_codes" if reference else "text")
        if reference:
            return Prompt(rows, {"x_vector": reference[2], "reference_codes": reference[1]})
        return rows

    def _in_context_rows(self, reference_text: str, codes: np.ndarray, text_ids: list[int]) -> list[list[int]]:
        """The reference's generate_icl_prompt (streaming mode): codec bos + the reference codes, summed with the
        reference transcript's ids + the target text's + tts_eos; the text beyond the codec rows is queued (its
        tts_eos left to the track), text shorter than them padded with tts_pad."""
        ref_ids = [self.im_start, *self.encode("assistant\n" + reference_text)][3:]  # the reference's ref_id[3:-2]
        if not ref_ids:
            raise InvalidRequest("reference_text has no tokens", field="reference_text")
        text = ref_ids + text_ids + [self.tts_eos]
        codec = [self._codec_row(self.codec_ids["bos"], -1)] + [[*map(int, frame), -1] for frame in codes]
        for row, text_id in zip(codec, text + [self.tts_pad] * (len(codec) - len(text))):
            row[-1] = text_id
        return codec + [self._codec_row(QUEUED, t) for t in text[len(codec):-1]]

    def _reference(self, reference_audio, reference_text, reference_codes, x_vector, text_open: bool):
        """Base: (transcript, codes int32 [T, groups], x-vector float32 [hidden]); other variants: None (and refused
        when given one). Cheap checks come before the clip goes through the encoders."""
        given = {"reference_audio": reference_audio, "reference_text": reference_text,
                 "reference_codes": reference_codes, "x_vector": x_vector}
        if not self.clones:
            name = next((k for k, v in given.items() if v is not None), None)
            if name is not None:
                raise InvalidRequest(f"{name}: a reference clip (voice cloning) is taken by Base checkpoints only; "
                                     f"this one is {self.variant}", field=name)
            return None
        if reference_audio is not None and (reference_codes is not None or x_vector is not None):
            raise InvalidRequest("reference_audio: send the clip or its codes and x-vector, not both",
                                 field="reference_audio")
        if reference_audio is None and (reference_codes is None or x_vector is None):
            if reference_text is not None:
                raise InvalidRequest("reference_text was given without a reference clip", field="reference_audio")
            raise InvalidRequest("Base (voice cloning) checkpoints need a reference clip and its transcript",
                                 field="reference_audio")
        if reference_text is None or reference_text == "":
            raise InvalidRequest("reference_text: the reference clip needs its transcript", field="reference_text")
        reference_text = self._text(reference_text, "reference_text")
        if text_open:
            raise InvalidRequest("voice cloning takes the whole text in one request, not in pieces (text "
                                 "streaming): the in-context prompt holds all of it", field="text")
        if reference_audio is not None:
            reference_codes, x_vector = self.encode_clip(reference_audio)
        checked = self.check_conditioning({"reference_codes": reference_codes, "x_vector": x_vector})
        return reference_text, checked["reference_codes"], checked["x_vector"]

    def encode_clip(self, audio: bytes | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A reference clip (file bytes, or float samples at 24 kHz) -> (codes [T, 16], x-vector [hidden]), kept
        for the last CACHED_CLIPS clips by content (the encoders are deterministic)."""
        samples = not isinstance(audio, bytes)
        raw = np.ascontiguousarray(audio, dtype=np.float32).tobytes() if samples else audio
        key = hashlib.sha256(raw).digest() + (b"samples" if samples else b"file")
        with self._voice_clone_lock:
            if key in self._clips:
                self._clips.move_to_end(key)
                return self._clips[key]
        front = self.voice_clone()
        clone = front.clone(audio, front.sample_rate if samples else None)
        encoded = clone.codes.numpy(), clone.x_vector.numpy()
        with self._voice_clone_lock:
            self.clips_encoded += 1
            self._clips[key] = encoded
            while len(self._clips) > CACHED_CLIPS:
                self._clips.popitem(last=False)
        return encoded

    def voice_clone(self):
        """Base: the speech tokenizer's encoder and the speaker encoder (CPU), loaded once, on the first clip."""
        with self._voice_clone_lock:
            if self._voice_clone is None:
                from voxbackend.components.speaker.ecapa_tdnn import EcapaTdnn
                from voxbackend.models.qwen3_tts.codec_encoder import Qwen3TTSEncoder
                from voxbackend.models.qwen3_tts.voice_clone import Qwen3TTSVoiceClone

                self._voice_clone = Qwen3TTSVoiceClone(Qwen3TTSEncoder.from_pretrained(self.speech_dir),
                                                       EcapaTdnn.from_checkpoint(self.model_dir))
            return self._voice_clone

    def check_conditioning(self, conditioning: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().check_conditioning(conditioning)
        if not self.clones and out:
            raise InvalidRequest(f"{sorted(out)[0]}: taken by Base checkpoints only", field=sorted(out)[0])
        codes, x_vector = out.get("reference_codes"), out.get("x_vector")
        if codes is not None:
            if codes.shape[1] != self.groups or not len(codes):
                raise InvalidRequest(f"reference_codes must be [frames >= 1, {self.groups}], got {list(codes.shape)}",
                                     field="reference_codes")
            if codes.min() < 0 or codes.max() >= self.code_size:
                raise InvalidRequest(f"reference_codes must be codes in [0, {self.code_size})",
                                     field="reference_codes")
            out["reference_codes"] = codes.astype(np.int32)
        if x_vector is not None:
            if x_vector.shape != (self.cfg.hidden_size,) or not np.isfinite(x_vector).all():
                raise InvalidRequest(f"x_vector must be {self.cfg.hidden_size} finite numbers (the talker's width), "
                                     f"got shape {list(x_vector.shape)}", field="x_vector")
            out["x_vector"] = x_vector.astype(np.float32)
        if self.clones and (codes is None) != (x_vector is None):
            missing = "reference_codes" if codes is None else "x_vector"
            raise InvalidRequest(f"{missing} is required with a reference clip", field=missing)
        return out

    def prompt_features(self, conditioning: dict[str, np.ndarray]) -> np.ndarray | None:
        """Base: the x-vector is the input of the prompt's FEATURE row (where CustomVoice has the speaker id)."""
        x_vector = conditioning.get("x_vector")
        return None if x_vector is None else x_vector[None]

    def encode(self, text: str) -> list[int]:
        return self.text_tokenizer.encode(text)

    def text_piece_ids(self, text: str) -> list[int]:
        return self.encode(text)

    def _text_row(self, text_id: int) -> list[int]:
        return [-1] * self.groups + [text_id]

    def _codec_row(self, codec_id: int, text_id: int) -> list[int]:
        return [codec_id] + [-1] * (self.groups - 1) + [text_id]

    def _text(self, text, field: str) -> str:
        return self.check_text(text, field)

    def _speaker(self, voice) -> str | None:
        if self.variant == "voice_design":
            if voice is not None and voice != "":
                raise InvalidRequest("voice is not taken by VoiceDesign checkpoints: describe the voice in instruct",
                                     field="voice")
            return None
        if self.clones:
            if voice is not None and voice != "":
                raise InvalidRequest("voice is not taken by Base checkpoints: send a reference clip "
                                     "(reference_audio with reference_text) to clone", field="voice")
            return None
        if voice is None or voice == "":
            return self.voices[0] if self.voices else None
        if not isinstance(voice, str) or voice.lower() not in self.speakers:
            raise InvalidRequest(f"voice {voice!r} is not a speaker of this checkpoint; speakers: "
                                 f"{', '.join(self.voices)}", field="voice")
        return voice.lower()

    def _language_id(self, language, speaker: str | None) -> int | None:
        if language is None or language == "":
            language = "auto"
        if not isinstance(language, str) or language.lower() not in self.supported_languages:
            raise InvalidRequest(f"language {language!r} is not supported; supported: "
                                 f"{', '.join(self.supported_languages)}", field="language")
        language = language.lower()
        dialect = self.dialects.get(speaker, False) if speaker else False
        if language in ("chinese", "auto") and dialect:  # a dialect speaker speaks its dialect
            return self.languages[dialect]
        return None if language == "auto" else self.languages[language]

    # ---------------------------------------------------------------- the dual track (engine thread)
    def split_prompt(self, prompt: list, text_open: bool) -> tuple[list, TextTrack]:
        n = len(prompt)
        while n and prompt[n - 1][0] == QUEUED:
            n -= 1
        positions, queued = prompt[:n], prompt[n:]
        if any(row[0] == QUEUED for row in positions):
            raise InvalidRequest("prompt rows: queued text rows must come after every position", field="prompt_ids")
        ids = self.check_track_ids([row[-1] for row in queued])
        # an in-context prompt whose text fits in its rows carries tts_eos there: the track only pads
        eos_in_prompt = any(row[-1] == self.tts_eos for row in positions)
        if eos_in_prompt and (ids or text_open):
            raise InvalidRequest("prompt rows: text queued after tts_eos", field="prompt_ids")
        return positions, TextTrack(deque(ids), open=text_open, eos_sent=eos_in_prompt)

    def check_track_ids(self, ids) -> list[int]:
        limit = self.text_tokenizer.first_added_id
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise InvalidRequest("text ids must be integers", field="text") from None
        if any(not 0 <= i < min(limit, self.text_vocab) for i in ids):
            raise InvalidRequest(f"text ids must be text tokens in [0, {min(limit, self.text_vocab)})", field="text")
        return ids

    def extend_track(self, track: TextTrack, ids: list[int], final: bool) -> None:
        if not track.open:
            raise InvalidRequest("the request's text is already closed", field="text")
        track.pending.extend(ids)
        track.open = not final

    def next_input(self, step: list[int], track: TextTrack) -> list[int] | None:
        if track.pending:
            text_id = track.pending.popleft()
        elif track.open:
            return None  # waits for more text: no tts_eos before the client says the text is complete
        elif not track.eos_sent:
            text_id, track.eos_sent = self.tts_eos, True
        else:
            text_id = self.tts_pad
        return [*step[: self.groups], text_id]

    # ---------------------------------------------------------------- steps -> codes
    def is_stop(self, step: list[int]) -> bool:
        return step[0] == self.eos

    def codes_from_step(self, step: list[int], codes_so_far: int) -> list[int]:
        return [] if step[0] == self.eos else list(step[: self.groups])
