"""CosyVoice2-0.5B: a Qwen2 LM that speaks 25 Hz S3 speech tokens, decoded by flow matching + HiFT at 24 kHz.

Facts of the reference (upstream CosyVoice `Qwen2LM`, `CosyVoice2Model`, `CosyVoiceFrontEnd`):
- LM input: [sos, prompt text tokens + text tokens, task id, prompt speech tokens], then one speech token per
  step. Text goes through the Qwen embedding, speech tokens through `speech_embedding` (6561 tokens + 3 specials),
  sos and task id are the two rows of `llm_embedding`; `llm_decoder` scores the 6561 + 3 speech ids.
- Generation stops on the end id 6561 (and, as the reference's vLLM path does, on the two ids above it, which
  only its bistream mode uses); the end ids are impossible before min_len = int(2 x text tokens), and the
  length is capped at max_len = int(20 x text tokens), text tokens not counting the prompt transcript.
- Sampling: repetition-aware (top-p 0.8, top-k 25; a draw already among the last 10 tokens is redrawn from the
  whole distribution).
Here all of it lives in one engine id space: text ids [0, T), speech ids at T + [0, 6564), sos at T + 6564 and
the task id at T + 6565 (T: the Qwen vocabulary), embedded by `forward`; the head's candidates are the speech
ids. The voice (prompt speech tokens, prompt mel, speaker embedding) comes from the voice-cloning front end in
`prepare` and reaches the detokenizer as the request's conditioning arrays. Text input streaming (the
reference's bistream mode, models/cosyvoice2/bistream.py): `prepare(text, text_open=True)` starts a request
whose track takes the rest of the text through `Engine.append_text`.

Checkpoint: the official folder (see docs/cosyvoice2.md): llm.pt (or llm.safetensors) with upstream names,
CosyVoice-BlankEN/config.json + tokenizer.json for the Qwen2 backbone and its tokenizer, flow.pt + hift.pt for
the detokenizer (voxbackend.components.flow_hift.token2wav), speech_tokenizer_v2 + campplus as safetensors for
cloning, and
voices/<name>.safetensors for named voices.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from voxbackend.components.flow_hift.token2wav import Token2WavConfig, load_token2wav
from voxbackend.errors import InvalidRequest
from voxbackend.models.base import LMGeometry, ModelSpec, Prompt, SpeechModel, WindowJob, WindowSpec
from voxbackend.models.cosyvoice2.bistream import Bistream, BistreamTrack
from voxbackend.models.cosyvoice2.cloning import VOICES_DIR, VoiceCloner, VoicePrompt, load_voice_cloner
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.text_tokens import TextTokenizer
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

SPEECH_TOKENS = 6561  # S3 tokenizer v2 codes; ids from here on in the speech space are the end and fill ids
SPEECH_ROWS = SPEECH_TOKENS + 3
SOS, TASK_ID = 0, 1  # rows of llm_embedding
MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2, 20
QWEN_FOLDER = "CosyVoice-BlankEN"
# the flow's noise buffer holds 300 s (7500 tokens) of prompt + speech; a 30 s voice prompt takes 750
MAX_TOKENS = 6000
MAX_STREAMED_TEXT_IDS = 2000  # bistream: text ids one utterance may add up to (room kept for them in the context)


def is_cosyvoice2_folder(folder: Path) -> bool:
    folder = Path(folder)
    return (any((folder / f"llm.{ext}").is_file() for ext in ("pt", "safetensors"))
            and (folder / QWEN_FOLDER / "config.json").is_file())


def load_state(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """`name`.safetensors, else the official `name`.pt state dict (torch.load, weights only)."""
    if (folder / f"{name}.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / f"{name}.safetensors"))
    return torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)


class CosyVoice2Frontend(SpeechModel):
    """Tokenizer, prompt rules, voices and spec without LM or detokenizer weights: the preprocess model's side."""

    text_streaming = True

    request_inputs = (
        TensorSpec("VOICE", "STRING", optional=True, arg="voice",
                   doc="a named voice (voices/<name>.safetensors in the checkpoint, or one cloned earlier under "
                       "this name); with REFERENCE_AUDIO: the name the cloned voice is cached under"),
        TensorSpec("REFERENCE_AUDIO", "STRING", optional=True, arg="reference_audio", kind="audio",
                   doc="zero-shot voice cloning: a WAV/FLAC/OGG clip of 0.5-30 s (any rate), with REFERENCE_TEXT"),
        TensorSpec("REFERENCE_TEXT", "STRING", optional=True, arg="reference_text",
                   doc="the transcript of REFERENCE_AUDIO"),
    )
    conditioning = (
        TensorSpec("PROMPT_SPEECH_TOKENS", "INT32", (-1,), arg="prompt_speech_tokens",
                   doc="the voice's 25 Hz speech tokens (flow prompt)"),
        TensorSpec("PROMPT_FEAT", "FP32", (-1, 80), arg="prompt_feat", doc="the voice's 50 Hz mel, 2 frames a token"),
        TensorSpec("SPEAKER_EMBEDDING", "FP32", (-1,), arg="speaker_embedding", doc="the voice's CAMPPlus vector"),
    )

    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None):
        self.model_dir = Path(model_dir)
        self.codec_dir = Path(codec_dir) if codec_dir else self.model_dir
        qwen = self.model_dir / QWEN_FOLDER
        self.cfg = DecoderConfig.from_hf(json.loads((qwen / "config.json").read_text()), family="qwen2")
        if not (qwen / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {qwen} (docs/cosyvoice2.md: write it once with "
                                    "transformers' AutoTokenizer.save_pretrained)")
        self.text_tokenizer = TextTokenizer(Tokenizer.from_file(str(qwen / "tokenizer.json")))
        self.text_vocab = self.cfg.vocab_size
        self.speech_base = self.text_vocab
        self.sos_id, self.task_id = self.speech_base + SPEECH_ROWS + SOS, self.speech_base + SPEECH_ROWS + TASK_ID
        codec_config = self.codec_dir / Token2WavConfig.CONFIG_NAME
        codec_cfg = (Token2WavConfig.from_dict(json.loads(codec_config.read_text())) if codec_config.is_file()
                     else Token2WavConfig())
        g = self.cfg.geometry()
        self.spec = ModelSpec(
            name="cosyvoice2",
            geometry=LMGeometry(g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim,
                                self.speech_base + SPEECH_ROWS + 2, g.max_context),
            sample_rate=codec_cfg.hift.sampling_rate,
            codes_per_frame=1,
            window=WindowSpec(frames=codec_cfg.stream.hop_tokens, hop_frames=codec_cfg.stream.hop_tokens,
                              first_frames=codec_cfg.stream.hop_tokens, flush_on_finish=True, stateful=True,
                              scheduled_by_model=True),
            stop_ids=tuple(self.speech_base + SPEECH_TOKENS + i for i in range(3)),
            max_tokens=MAX_TOKENS,
        )
        self.bistream = Bistream(sos=self.sos_id, task=self.task_id, fill=self.speech_base + SPEECH_TOKENS + 2)
        self.voices_dir = self.model_dir / VOICES_DIR
        self.voices = tuple(sorted(p.stem for p in self.voices_dir.glob("*.safetensors")))
        self._cloner: VoiceCloner | None = None
        self._cloner_lock = threading.Lock()

    # ---------------------------------------------------------------- voices
    def cloner(self) -> VoiceCloner:
        """The S3 tokenizer + CAMPPlus front end, loaded on the first voice request."""
        with self._cloner_lock:
            if self._cloner is None:
                try:
                    self._cloner = load_voice_cloner(self.model_dir)
                except FileNotFoundError as e:
                    raise InvalidRequest(f"this checkpoint cannot clone voices ({e}); name a stored voice",
                                         field="reference_audio") from None
        return self._cloner

    def voice_prompt(self, voice: str | None, audio: bytes | None, transcript: str | None) -> VoicePrompt:
        if voice is None and audio is None and transcript is None:
            if not self.voices:
                raise InvalidRequest(f"give VOICE or REFERENCE_AUDIO with REFERENCE_TEXT (the checkpoint has no "
                                     f"{VOICES_DIR}/ voices)", field="voice")
            voice = self.voices[0]
        if audio is None and transcript is None and voice in self.voices and self._cloner is None:
            # a stored voice needs none of the cloning networks (the official folder ships them as ONNX only)
            return VoicePrompt.load(self.voices_dir / f"{voice}.safetensors")
        return self.cloner().voice(voice, audio, None, transcript)

    # ---------------------------------------------------------------- preprocessing
    def prepare(self, text: str, voice: str | None = None, reference_audio: bytes | None = None,
                reference_text: str | None = None, *, text_open: bool = False) -> Prompt:
        self.check_text(text, allow_blank=text_open)
        prompt = self.voice_prompt(voice, reference_audio, reference_text)
        text_ids = self.text_tokenizer.encode(text)
        prompt_text_ids = self.text_tokenizer.encode(prompt.transcript)
        speech = prompt.speech_tokens.to(torch.int64).tolist()
        build = self.build_bistream_prompt if text_open else self.build_prompt
        return build(text_ids, prompt_text_ids, speech, prompt.speech_feat.numpy(), prompt.embedding.numpy())

    def build_prompt(self, text_ids: list[int], prompt_text_ids: list[int], prompt_speech: list[int],
                     prompt_feat: np.ndarray, embedding: np.ndarray) -> Prompt:
        """Token ids and the voice's arrays -> the LM prompt, the request's length rules and its conditioning."""
        if not text_ids:
            raise InvalidRequest("text has no tokens", field="text")
        ids = [self.sos_id, *prompt_text_ids, *text_ids, self.task_id, *(self.speech_base + t for t in prompt_speech)]
        # the reference's rules, from the text's own token count (not the prompt transcript's)
        max_tokens = int(len(text_ids) * MAX_TOKEN_TEXT_RATIO)
        room = self.spec.geometry.max_context - len(ids)
        if room < 1:
            raise InvalidRequest(f"prompt is {len(ids)} tokens; the model's context is "
                                 f"{self.spec.geometry.max_context}", field="text")
        return Prompt(ids, _voice_conditioning(prompt_speech, prompt_feat, embedding),
                      min_tokens=int(len(text_ids) * MIN_TOKEN_TEXT_RATIO),
                      max_tokens=min(max_tokens, room))

    def build_bistream_prompt(self, text_ids: list[int], prompt_text_ids: list[int], prompt_speech: list[int],
                              prompt_feat: np.ndarray, embedding: np.ndarray) -> Prompt:
        """The first piece of a streamed text: `[sos, transcript + piece, prompt speech]`, which split_prompt turns
        into the bistream track (Engine.submit(..., text_open=True)). Upstream has no length rules here: the
        budget is what the context leaves after room for the streamed text."""
        ids = [self.sos_id, *prompt_text_ids, *text_ids, *(self.speech_base + t for t in prompt_speech)]
        room = self.spec.geometry.max_context - len(ids) - MAX_STREAMED_TEXT_IDS - 1
        if room < 1:
            raise InvalidRequest(f"prompt is {len(ids)} tokens; the model's context is "
                                 f"{self.spec.geometry.max_context}", field="text")
        return Prompt(ids, _voice_conditioning(prompt_speech, prompt_feat, embedding), max_tokens=min(MAX_TOKENS, room))

    # ---------------------------------------------------------------- text streaming (engine thread)
    def text_piece_ids(self, text: str) -> list[int]:
        return self.text_tokenizer.encode(text)

    def check_track_ids(self, ids) -> list[int]:
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise InvalidRequest("text ids must be integers", field="text") from None
        if any(not 0 <= i < self.text_vocab for i in ids):
            raise InvalidRequest(f"text ids must be in [0, {self.text_vocab})", field="text")
        return ids

    def split_prompt(self, prompt: list, text_open: bool) -> tuple[list, BistreamTrack | None]:
        if not text_open:
            return prompt, None
        speech = [i for i in prompt[1:] if i >= self.speech_base]
        text = prompt[1:len(prompt) - len(speech)]
        if (not prompt or prompt[0] != self.sos_id or any(not 0 <= i < self.text_vocab for i in text)
                or any(not 0 <= i - self.speech_base < SPEECH_TOKENS for i in speech)):
            raise InvalidRequest("a streamed-text prompt is [sos, text ids, prompt speech ids] "
                                 "(build_bistream_prompt)", field="prompt_ids")
        if len(text) > MAX_STREAMED_TEXT_IDS:
            raise InvalidRequest(f"text is {len(text)} tokens; a streamed text may have {MAX_STREAMED_TEXT_IDS}",
                                 field="text")
        return self.bistream.start(text, speech, open=True)

    def extend_track(self, track: BistreamTrack | None, ids: list[int], final: bool) -> None:
        if track is None:
            raise InvalidRequest("this request was not submitted with text_open", field="text")
        if not track.open:
            raise InvalidRequest("the request's text is already closed", field="text")
        if track.text_ids + len(ids) > MAX_STREAMED_TEXT_IDS:
            raise InvalidRequest(f"the streamed text exceeds {MAX_STREAMED_TEXT_IDS} tokens", field="text")
        self.bistream.extend(track, ids, final)

    def waits_for_input(self, track: BistreamTrack | None) -> bool:
        return track is not None and track.waiting

    def next_inputs(self, step: int | None, track: BistreamTrack | None) -> list[int] | None:
        return [step] if track is None else self.bistream.next_inputs(step, track)

    def track_max_tokens(self, track: BistreamTrack | None) -> int | None:
        """Ours, not upstream's (whose bistream has no length rule): a streamed utterance gets at most the whole
        text's max_len, 20 x the text tokens received so far (the prompt transcript counted too: a streamed prompt
        does not tell them apart). Upstream pulls the next piece only when the LM picks the fill token; one that
        never does (the tiny random checkpoint) generated on the first piece up to MAX_TOKENS, at 0.15x real time,
        never reading the rest. A model that picks fills waits for text every 15 tokens and stays far below."""
        return int(track.text_ids * MAX_TOKEN_TEXT_RATIO) if track is not None else None

    def ends(self, step: int, track: BistreamTrack | None) -> bool:
        # while the text streams the end ids are excluded and the fill is an ordinary step (constrain_logits)
        return self.is_stop(step) if track is None or track.final else False

    def check_conditioning(self, conditioning: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().check_conditioning(conditioning)
        tokens = out["prompt_speech_tokens"]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= SPEECH_TOKENS):
            raise InvalidRequest(f"prompt_speech_tokens must be in [0, {SPEECH_TOKENS})", field="prompt_speech_tokens")
        if out["prompt_feat"].shape[0] != 2 * tokens.size:
            raise InvalidRequest(f"prompt_feat has {out['prompt_feat'].shape[0]} frames; 2 per prompt speech token "
                                 f"({2 * tokens.size}) are needed", field="prompt_feat")
        return out

    def default_sampling(self) -> SamplingParams:
        # the official ras_sampling defaults (cosyvoice2.yaml): top-p 0.8, top-k 25, window 10, tau_r 0.1
        return SamplingParams(temperature=1.0, top_p=0.8, top_k=25, ras_window=10, ras_tau_r=0.1,
                              max_tokens=MAX_TOKENS)


class CosyVoice2(CosyVoice2Frontend):
    def __init__(self, model_dir: str | Path, codec_dir: str | Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, lm: bool = True):
        super().__init__(model_dir, codec_dir)
        self.device = device
        self.codec = load_token2wav(self.codec_dir, device, dtype)
        if not lm:  # a codec stage's copy: detokenize only
            return
        weights = load_state(self.model_dir, "llm")
        self.backbone = build_decoder(self.cfg, weights, device, dtype, prefix="llm.model.model.", head=False)
        speech = weights["speech_embedding.weight"]
        if speech.shape[0] != SPEECH_ROWS or weights["llm_decoder.weight"].shape[0] != SPEECH_ROWS:
            raise ValueError(f"llm.pt: speech_embedding / llm_decoder have {speech.shape[0]} / "
                             f"{weights['llm_decoder.weight'].shape[0]} rows, expected {SPEECH_ROWS}")
        # speech ids, then sos and task id: every id from T on indexes this one table
        self.extra_embedding = torch.cat([speech, weights["llm_embedding.weight"]]).to(device, dtype)
        self.head_weight = weights["llm_decoder.weight"].to(device, dtype)
        self.head_bias = weights["llm_decoder.bias"].to(device, dtype)
        self._speech_ids = self.speech_base + torch.arange(SPEECH_ROWS, device=device)[None, :]

    # ---------------------------------------------------------------- LM
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        text = F.embedding(input_ids.clamp(max=self.text_vocab - 1), self.backbone.embed.weight)
        extra = F.embedding((input_ids - self.speech_base).clamp(min=0), self.extra_embedding)
        return torch.where((input_ids < self.speech_base)[:, None], text, extra)

    def forward(self, input_ids, positions, attention):
        return self.backbone.forward_embeds(self.embed(input_ids), positions, attention)

    def candidate_logits(self, hidden: torch.Tensor, codes_so_far: list[int]):
        logits = F.linear(hidden, self.head_weight, self.head_bias).float()
        return logits, self._speech_ids.expand(len(hidden), -1)

    def constrain_logits(self, logits: torch.Tensor, token_ids, tracks: list) -> torch.Tensor:
        """Bistream rows: before the text ends no end id (nor the unused id after it) and the fill forced when due;
        after it no fill (upstream raises on one there) nor the unused id: generation runs to the end id."""
        streamed = [(i, t) for i, t in enumerate(tracks) if t is not None]
        if not streamed:
            return logits
        logits = logits.clone()
        end = SPEECH_TOKENS  # candidate columns are the speech ids in order
        for i, track in streamed:
            if track.final:
                logits[i, end + 1:end + 3] = float("-inf")
            elif self.bistream.forced_fill(track):
                logits[i] = float("-inf")
                logits[i, end + 2] = 0.0
            else:
                logits[i, end:end + 2] = float("-inf")
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((len(hidden), self.spec.geometry.vocab_size), float("-inf"), device=hidden.device)
        logits[:, self.speech_base:self.speech_base + SPEECH_ROWS] = self.candidate_logits(hidden, [])[0]
        return logits

    def codes_from_step(self, token: int, codes_so_far: int) -> list[int]:
        code = token - self.speech_base
        return [code] if 0 <= code < SPEECH_TOKENS else []

    # ---------------------------------------------------------------- detokenizer
    def new_codec_state(self, conditioning):
        # windows as the reference cuts the complete token sequence: the audio does not depend on timing
        return self.codec.new_stream(conditioning["prompt_speech_tokens"], conditioning["prompt_feat"],
                                     conditioning["speaker_embedding"], as_complete=True)

    def windows_ready(self, state, codes: list[int], lm_done: bool) -> int:
        if len(codes) > len(state.tokens):
            state.push(codes[len(state.tokens):])
        if lm_done and not state.ended:
            state.end()
        return 1 if self.codec.window_due(state) else 0

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        for job in jobs:
            if job.index == 0:  # the request's HiFT excitation noise follows its seed
                job.state.generator.manual_seed(job.seed)
        return [a.numpy().astype(np.float32, copy=False) for a in self.codec.decode([j.state for j in jobs])]


def _voice_conditioning(prompt_speech: list[int], prompt_feat: np.ndarray, embedding: np.ndarray) -> dict:
    """A request's conditioning from its voice: what the flow decoder needs besides the LM's tokens."""
    return {"prompt_speech_tokens": np.asarray(prompt_speech, dtype=np.int32),
            "prompt_feat": np.asarray(prompt_feat, dtype=np.float32),
            "speaker_embedding": np.asarray(embedding, dtype=np.float32).reshape(-1)}
