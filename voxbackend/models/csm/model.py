"""CSM-1B (Sesame): a Llama backbone predicts Mimi codebook 0 of each 80 ms frame, a small depth decoder the other 31.

Follows transformers' CsmForConditionalGeneration (checkpoint layout of `sesame/csm-1b`):
  * prompt: one segment per utterance, `<|begin_of_text|>[{speaker}]{text}<|end_of_text|>`; a context segment
    is followed by its audio frames and one all-zero "audio eos" frame. Rows have 33 columns: 32 codebooks
    and the text id, -1 where a row has no entry (text rows have no codes, audio rows no text id);
  * backbone input: text embedding of the text id plus the sum of the codebook embeddings (codebook k id c at
    row k * vocab + c of the audio table);
  * depth decoder, per frame: position 0 is the backbone's final hidden state, position k >= 1 the embedding of
    codebook k - 1 (the same table, shared with the backbone); both go through a projection to the depth width;
    the hidden state at position k >= 1 goes through codebook k's own head to give codebook k;
  * stop: a frame whose codebooks 0..30 are all the eos id (0); an all-eos frame is not audio.
Context audio enters as Mimi codes [frames, 32] or as a waveform, which `prepare` (preprocessing, the caller's thread)
encodes with the Mimi encoder, loaded on first use from the same codec weights. `CsmFrontend` is just that
preprocessing side (tokenizer, prompt rules, spec, the lazy encoder); `Csm` adds the backbone, depth and codec weights.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from voxbackend.audio_io import read_audio
from voxbackend.components.mimi.decoder import MimiDecoder
from voxbackend.components.mimi.encoder import MimiEncoder
from voxbackend.components.mimi.weights import frame_size, read_codec_config
from voxbackend.errors import InvalidRequest
from voxbackend.ints import to_host
from voxbackend.models.base import ModelSpec, SpeechModel, WindowJob, WindowSpec
from voxbackend.models.checkpoint import load_safetensors, read_config
from voxbackend.models.decoder import DecoderConfig, build_decoder
from voxbackend.models.depth_columns import DepthColumns
from voxbackend.models.text_tokens import TextTokenizer
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
NUM_SPEAKERS = 10  # speaker ids are conversation roles; single digits as in the model card's examples
MAX_FRAMES = 1125  # 90 s, the official generator's default limit


def is_csm_config(hf_config: dict) -> bool:
    return ("CsmForConditionalGeneration" in (hf_config.get("architectures") or ())
            or hf_config.get("model_type") == "csm")


@dataclass
class ContextSegment:
    """An earlier utterance that conditions the voice: its text, speaker and audio, given either as Mimi codes
    [frames, 32] or as a waveform: float32 mono samples at `sample_rate` (default the codec's 24 kHz), or audio
    file bytes (WAV, FLAC; the file's own rate). Other rates are resampled."""

    text: str
    speaker: int
    codes: np.ndarray | None = None
    audio: np.ndarray | bytes | None = None
    sample_rate: int | None = None


class CsmFrontend(SpeechModel):
    """Tokenizer, prompt rules and spec without LM or codec decoder weights: what preprocessing instances need.
    The only weights it may load are the Mimi encoder's, on the first request whose context is a waveform."""

    request_inputs = (
        TensorSpec("SPEAKER", "INT32", optional=True, doc="speaker id of TEXT, in [0, 10); 0 when absent",
                   arg="speaker"),
        TensorSpec("CONTEXT_TEXT", "STRING", (-1,), optional=True,
                   doc="context segments (earlier turns that set the voice): one UTF-8 text per segment",
                   arg="text", segment="context"),
        TensorSpec("CONTEXT_SPEAKER", "INT32", (-1,), optional=True, doc="speaker id per context segment",
                   arg="speaker", segment="context"),
        TensorSpec("CONTEXT_AUDIO", "STRING", (-1,), optional=True,
                   doc="audio per context segment: a WAV/FLAC/OGG file's bytes (any rate: resampled), or raw "
                       "little-endian float32 mono samples when CONTEXT_SAMPLE_RATE is sent",
                   arg="audio", segment="context", kind="audio"),
        TensorSpec("CONTEXT_SAMPLE_RATE", "INT32", (-1,), optional=True,
                   doc="Hz of raw float32 CONTEXT_AUDIO: one value for all segments or one per segment",
                   arg="sample_rate", segment="context", kind="rate"),
    )

    def __init__(
        self,
        model_dir: str | Path,
        codec_dir: str | Path | None = None,
        device: str = "cpu",
        first_window_frames: int = 2,
        window_frames: int = 10,
    ):
        hf = read_config(model_dir)
        self.device = device
        self.num_codebooks = K = hf["num_codebooks"]
        self.vocab = hf["vocab_size"]
        self.text_vocab = hf["text_vocab_size"]
        self.eos_code = hf.get("codebook_eos_token_id", 0)
        self.cfg = DecoderConfig.from_hf(hf, family="llama")
        self.tokenizer = self._load_tokenizer(Path(model_dir))
        self.bos, self.eos = self.tokenizer.token_to_id(BOS), self.tokenizer.token_to_id(EOS)
        self.text_tokenizer = TextTokenizer(self.tokenizer)  # user text never becomes a control token

        # no codec_dir: the Mimi weights inside the checkpoint; only its config is read here
        self.codec_source = (Path(codec_dir), "") if codec_dir is not None else (Path(model_dir), "codec_model.")
        codec = read_codec_config(self.codec_source[0])
        self.codebook_size: int = codec["codebook_size"]
        self.codec_sample_rate: int = codec["sampling_rate"]
        self.codec_frame_rate = self.codec_sample_rate / frame_size(codec)
        if codec["num_quantizers"] < K:
            raise ValueError(f"the Mimi codec has {codec['num_quantizers']} codebooks; CSM needs {K}")
        self._encoder: MimiEncoder | None = None  # loaded by the first request with context audio
        self._encoder_lock = threading.Lock()
        self.spec = ModelSpec(
            name="csm",
            geometry=self.cfg.geometry(),
            sample_rate=self.codec_sample_rate,
            codes_per_frame=K,
            # streaming Mimi carries its state between windows, so a short first window is exact
            window=WindowSpec(frames=window_frames, hop_frames=window_frames, first_frames=first_window_frames,
                              flush_on_finish=True, stateful=True),
            stop_ids=(),
            token_columns=K + 1,
            has_depth=True,
            column_vocab=(self.vocab,) * K + (self.text_vocab,),
            max_tokens=MAX_FRAMES,  # one LM step per frame
        )

    @staticmethod
    def _load_tokenizer(model_dir: Path) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        tok = Tokenizer.from_file(str(path))
        if tok.token_to_id(BOS) is None or tok.token_to_id(EOS) is None:
            raise ValueError(f"{path} lacks the Llama-3 tokens {BOS} / {EOS}")
        return tok

    # ---------------------------------------------------------------- preprocessing
    def prepare(self, text: str, speaker: int | str | None = None, context: list | None = None) -> list[list[int]]:
        rows: list[list[int]] = []
        for i, seg in enumerate(context or []):
            seg = self._segment(seg, f"context[{i}]")
            rows += self._text_rows(seg.text, seg.speaker, f"context[{i}].text")
            rows += [[*frame, -1] for frame in seg.codes.tolist()]
            rows.append([self.eos_code] * self.num_codebooks + [-1])  # audio eos frame
        rows += self._text_rows(text, self._speaker(0 if speaker is None else speaker, "speaker"), "text")
        if len(rows) >= self.spec.geometry.max_context:
            raise InvalidRequest(
                f"prompt is {len(rows)} positions (text and context audio); the model's context is "
                f"{self.spec.geometry.max_context}"
            )
        return rows

    def _text_rows(self, text: str, speaker: int, field: str) -> list[list[int]]:
        self.check_text(text, field)
        ids = [self.bos, *self.text_tokenizer.encode(f"[{speaker}]{text}"), self.eos]
        if max(ids) >= self.text_vocab:
            raise InvalidRequest(f"{field} contains special tokens outside the model's text vocabulary", field=field)
        return [[-1] * self.num_codebooks + [t] for t in ids]

    def _speaker(self, speaker, field: str) -> int:
        if isinstance(speaker, str) and speaker.strip().isdigit():
            speaker = int(speaker)
        if isinstance(speaker, bool) or not isinstance(speaker, (int, np.integer)):
            raise InvalidRequest(f"{field} must be an integer id in [0, {NUM_SPEAKERS}), got {speaker!r}",
                                 field=field)
        if not 0 <= speaker < NUM_SPEAKERS:
            raise InvalidRequest(f"{field} must be in [0, {NUM_SPEAKERS}), got {speaker}", field=field)
        return int(speaker)

    def _segment(self, seg, field: str) -> ContextSegment:
        if isinstance(seg, dict):
            unknown = set(seg) - {"text", "speaker", "codes", "audio", "sample_rate"}
            if unknown:
                raise InvalidRequest(f"{field} has unknown keys {sorted(unknown)}", field=field)
            try:
                seg = ContextSegment(seg["text"], seg["speaker"], seg.get("codes"), seg.get("audio"),
                                     seg.get("sample_rate"))
            except KeyError as exc:
                raise InvalidRequest(f"{field} needs text, speaker and codes or audio; missing {exc}",
                                     field=field) from None
        if not isinstance(seg, ContextSegment):
            raise InvalidRequest(f"{field} must be a ContextSegment or a dict, got {type(seg).__name__}", field=field)
        if (seg.codes is None) == (seg.audio is None):
            raise InvalidRequest(f"{field} needs exactly one of codes (Mimi codes) and audio (a waveform)", field=field)
        speaker = self._speaker(seg.speaker, f"{field}.speaker")
        if seg.audio is not None:
            return ContextSegment(seg.text, speaker, self._encode_context(seg, f"{field}.audio"))
        codes = np.asarray(seg.codes.cpu() if isinstance(seg.codes, torch.Tensor) else seg.codes)
        field = f"{field}.codes"
        if codes.dtype.kind == "f":
            raise InvalidRequest(f"{field}: raw audio goes in the segment's audio (with its sample_rate); "
                                 f"codes are Mimi codes [frames, {self.num_codebooks}]", field=field)
        if codes.dtype.kind not in "iu" or codes.ndim != 2 or codes.shape[1] != self.num_codebooks or not len(codes):
            raise InvalidRequest(f"{field} must be integer Mimi codes [frames, {self.num_codebooks}], "
                                 f"got {codes.dtype} {list(codes.shape)}", field=field)
        if codes.min() < 0 or codes.max() >= self.codebook_size:
            raise InvalidRequest(f"{field} must be in [0, {self.codebook_size})", field=field)
        return ContextSegment(seg.text, speaker, codes.astype(np.int64))

    def _encode_context(self, seg: ContextSegment, field: str) -> np.ndarray:
        is_file = isinstance(seg.audio, (bytes, bytearray, memoryview)) or (
            isinstance(seg.audio, np.ndarray) and seg.audio.dtype.kind in "OSV")
        rate = seg.sample_rate if seg.sample_rate is not None or is_file else self.codec_sample_rate
        # longer audio could never fit the prompt; refuse before spending the encoder on it
        max_s = self.spec.geometry.max_context / self.codec_frame_rate
        audio = read_audio(seg.audio, rate, self.codec_sample_rate, max_seconds=max_s, field=field)
        return self.encode_audio(audio)

    @property
    def encoder(self) -> MimiEncoder:
        with self._encoder_lock:  # preprocessing may run on several threads
            if self._encoder is None:
                path, prefix = self.codec_source
                self._encoder = MimiEncoder.from_pretrained(path, device=self.device, prefix=prefix)
        return self._encoder

    def encode_audio(self, audio: np.ndarray) -> np.ndarray:
        """float32 mono at the codec's rate -> Mimi codes [frames, num_codebooks] (int64)."""
        x = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))[None, None]
        return self.encoder.encode(x, self.num_codebooks)[0].T.cpu().numpy()

    def default_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=50, max_tokens=MAX_FRAMES)


class Csm(CsmFrontend):
    def __init__(
        self,
        model_dir: str | Path,
        codec_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        first_window_frames: int = 2,
        window_frames: int = 10,
        lm: bool = True,
    ):
        super().__init__(model_dir, codec_dir, device, first_window_frames, window_frames)
        path, prefix = self.codec_source
        self.codec = MimiDecoder.from_pretrained(path, device=device, dtype=dtype, prefix=prefix)
        if not lm:  # a codec stage's copy: detokenize only
            return
        w = load_safetensors(model_dir)
        self.backbone = build_decoder(self.cfg, w, device, dtype, prefix="backbone_model.", embed=False)
        depth_cfg = DecoderConfig.from_hf(read_config(model_dir)["depth_decoder_config"], family="llama")
        self.depth = build_decoder(depth_cfg, w, device, dtype, prefix="depth_decoder.model.", embed=False, head=False)

        def take(*names: str) -> torch.Tensor:  # the first name present (tied tables are saved once)
            for n in names:
                if n in w:
                    return w[n].to(device=device, dtype=dtype)
            raise KeyError(f"checkpoint is missing weight {names[0]!r}")

        audio = "backbone_model.embed_tokens.embed_audio_tokens.weight"
        self.text_embed = take("embed_text_tokens.weight")
        self.audio_embed = take(audio, "depth_decoder.model.embed_tokens.weight")  # [K * V, hidden]
        self.depth_embed = take("depth_decoder.model.embed_tokens.weight", audio)
        self.depth_proj = take("depth_decoder.model.inputs_embeds_projector.weight")  # [depth hidden, hidden]
        self.depth_heads = take("depth_decoder.codebooks_head.weight")  # [K - 1, depth hidden, V]
        self.offsets = torch.arange(self.num_codebooks, device=device) * self.vocab
        w.clear()  # the device copies are taken; drop the CPU tensors
        V = self.vocab
        self.depth_columns = DepthColumns(  # codebook k enters at position k + 1 through the shared table
            self.depth, self.num_codebooks, project=lambda x: x @ self.depth_proj.T,
            head=lambda h, k: (h @ self.depth_heads[k - 1]).float(), embed_first=lambda ids: self.depth_embed[ids],
            embed_next=lambda ids, k: self.depth_embed[ids + k * V])

    # ---------------------------------------------------------------- LM
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """input_ids [T, 33]: the masked sum of the text embedding and the 32 codebook embeddings of each row."""
        K = self.num_codebooks
        codes, text = input_ids[:, :K], input_ids[:, K]
        audio = self.audio_embed[codes.clamp(min=0) + self.offsets]  # [T, K, hidden]
        x = torch.where((codes >= 0)[..., None], audio, 0.0).sum(1)
        x = x + torch.where((text >= 0)[:, None], self.text_embed[text.clamp(min=0)], 0.0)
        return self.backbone.forward_embeds(x, positions, attention)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backbone.logits(hidden)

    def depth_step(self, hidden: torch.Tensor, first: torch.Tensor, sample_column) -> torch.Tensor:
        codes = self.depth_columns.run(hidden, first, sample_column)
        return torch.cat([codes, torch.full_like(first, -1)[:, None]], dim=1)  # the text column is empty

    # ---------------------------------------------------------------- steps -> codes
    def is_stop(self, step: list[int]) -> bool:
        return all(c == self.eos_code for c in step[: self.num_codebooks - 1])

    def codes_from_step(self, step: list[int], codes_so_far: int) -> list[int]:
        frame = step[: self.num_codebooks]
        return [] if all(c == self.eos_code for c in frame) else frame

    # ---------------------------------------------------------------- codec
    def new_codec_state(self, conditioning):
        return self.codec.new_state()

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        """Windows of equal length decode in one batch, each row continuing its request's Mimi state."""
        out: list[torch.Tensor | None] = [None] * len(jobs)
        groups: dict[int, list[int]] = {}
        for i, j in enumerate(jobs):
            groups.setdefault(len(j.codes), []).append(i)
        for idx in groups.values():
            codes = torch.as_tensor(np.stack([jobs[i].codes for i in idx]), device=self.device).transpose(1, 2)
            # the LM samples 2051 ids per codebook; the 3 above Mimi's 2048 are specials (pad, ...) that a
            # trained model does not emit mid-frame: clamp so a stray one cannot crash or alias the codec
            codes = codes.clamp(max=self.codec.codebook_size - 1)
            audio = self.codec.decode_chunk(codes, [jobs[i].state for i in idx])
            for row, i in enumerate(idx):
                out[i] = audio[row, 0]
        return [a.numpy() for a in to_host(out)]
