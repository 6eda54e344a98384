"""The model contract: what the engine needs to know about a SpeechLM and what it may ask it to do.

A model file declares a `ModelSpec` and implements `SpeechModel`. The engine and scheduler only see this
interface, so a new SpeechLM plugs in without touching them: one token per step (Orpheus, CosyVoice2,
Chatterbox) or several codebook columns plus a depth transformer (CSM, Qwen3-TTS; a delay pattern like Zonos is
a column layout). A dual-track model (Qwen3-TTS) makes each next backbone input from the sampled step plus
per-request state (the next text token): `split_prompt` / `next_input` / `extend_track`; a track may also feed
several positions after a step, hold the first sample, and set per-request logit rules and stops (CosyVoice2's
bistream: `next_inputs`, `waits_for_input`, `constrain_logits`, `ends`). A prompt position whose input is a vector
rather than ids (Qwen3-TTS Base: the x-vector speaker embedding; speech-to-speech models: audio-encoder features)
is a FEATURE row: the model returns the request's vectors from its conditioning (`prompt_features`), and `forward`
receives them at those rows of the flattened batch (`features`). A model with classifier-free guidance (Chatterbox;
`ModelSpec.guidance`) gives the unconditioned row's prompt (`unconditioned_prompt`, `unconditioned_features`); the
engine runs both rows of a request together and combines their logits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from voxbackend.attention.base import AttentionBackend
from voxbackend.errors import InvalidRequest
from voxbackend.sampling_params import SamplingParams
from voxbackend.tensor_spec import TensorSpec


@dataclass(frozen=True)
class LMGeometry:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int


@dataclass(frozen=True)
class WindowSpec:
    """How codec frames are cut into detokenizer windows.

    Window k ends at frame `first_frames + k * hop_frames` and spans at most `frames` frames, so consecutive
    windows overlap by `frames - hop_frames`. A stateful codec (streaming Mimi) uses hop == frames and carries
    its state between windows instead of overlapping.
    """

    frames: int
    hop_frames: int
    first_frames: int
    flush_on_finish: bool  # decode the partial tail window when the LM stops
    stateful: bool = False  # windows of one request must be decoded one at a time, in order
    # the codec's per-request state says when a window is due (SpeechModel.windows_ready), and each job gets all
    # frames so far; frames/hop/first are then nominal. For schedules that depend on the request (CosyVoice2:
    # a first window sized by the prompt, a final flush that depends on the tail). Needs stateful.
    scheduled_by_model: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str
    geometry: LMGeometry
    sample_rate: int
    codes_per_frame: int  # codec codes that make one frame (Orpheus: 7 tokens; CSM: 32 codebooks of one step)
    window: WindowSpec | None  # None: a token-only model (no codec)
    stop_ids: tuple[int, ...]
    token_columns: int = 1  # ids per LM position (codebooks + text column for CSM / Qwen3-TTS)
    has_depth: bool = False  # a depth transformer produces the remaining columns of each step
    # token_columns > 1: prompt rows hold ids of column j in [0, column_vocab[j]), or -1 where a row has no entry
    column_vocab: tuple[int, ...] = ()
    # the most LM steps one request may ask for, as the official implementation caps generation; 0: the context
    max_tokens: int = 0
    # the columns the repetition penalty looks at (None: all) and whether it counts prompt ids or generated ones only
    penalty_columns: tuple[int, ...] | None = None
    penalty_on_prompt: bool = True
    # classifier-free guidance: a request with sampling.cfg_weight > 0 runs a second, unconditioned LM row (its
    # prompt from unconditioned_prompt / unconditioned_features; its generated inputs the same) that steps with
    # the first; each step samples from cond + cfg_weight * (cond - uncond). Models without it refuse cfg_weight.
    guidance: bool = False


@dataclass
class Prompt:
    """What `prepare` returns when a request carries more than its ids (a plain id list means ids only)."""

    ids: list[int] | list[list[int]]
    # per-request arrays for the codec, one per SpeechModel.conditioning spec (keyed by its arg); they reach
    # new_codec_state at admission (CosyVoice2: the voice's prompt speech tokens, prompt mel, speaker embedding)
    conditioning: dict[str, np.ndarray] = field(default_factory=dict)
    # the model's length rules for this request (CosyVoice2's come from its text length); a client's own
    # sampling may only tighten them
    min_tokens: int = 0
    max_tokens: int | None = None

    def limit(self, params: SamplingParams) -> SamplingParams:
        """`params` within this prompt's length rules."""
        max_tokens = params.max_tokens if self.max_tokens is None else min(params.max_tokens, self.max_tokens)
        return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=max(params.min_tokens, self.min_tokens))


def as_prompt(prepared: "Prompt | list") -> Prompt:
    return prepared if isinstance(prepared, Prompt) else Prompt(prepared)


@dataclass
class WindowJob:
    """One detokenizer window of one request."""

    request_id: str
    index: int  # window number within its request (0, 1, ...)
    codes: np.ndarray  # [frames, codes_per_frame] int
    seed: int  # deterministic codec noise for this window
    is_last: bool  # False for model-scheduled windows: their state knows
    state: Any = None  # per-request codec state for stateful codecs


# A prompt row whose column 0 is QUEUED is not a position: its last column is an id queued for the model's
# next inputs (the dual track's text), which `split_prompt` moves into the request's input track.
QUEUED = -2
# A prompt row whose column 0 (for a one-column model: whose id) is FEATURE is a position whose backbone-side input
# is a vector: the request's next prompt feature row (SpeechModel.prompt_features), in prompt order. Ids in its
# other columns (a text column) still add their embeddings.
FEATURE = -3


@dataclass(frozen=True)
class PromptFeatures:
    """The FEATURE rows of one flattened batch: where they are and what goes there."""

    rows: torch.Tensor  # [F] long: indices into the batch's flattened positions
    vectors: torch.Tensor  # [F, hidden]: each row's input vector


class SpeechModel:
    """Base class: a backbone plus the model-specific rules around it."""

    spec: ModelSpec
    voices: tuple[str, ...] = ()
    request_inputs: tuple[TensorSpec, ...] = ()  # the model's own request inputs beyond TEXT and sampling
    text_streaming: bool = False  # text may keep arriving after submission (Engine.append_text)
    text_required: bool = True  # False: a request may come without text (a spoken-dialogue model's audio turn)
    codec_stage: bool = True  # its windows (codec state included) can go over the codec wire to a codec stage
    # per-request arrays prepare() computes for the codec (Prompt.conditioning, keyed by arg); the Triton glue
    # carries them from the preprocess to the engine under these names
    conditioning: tuple[TensorSpec, ...] = ()
    max_text_chars: int = 4000  # the most characters one request's text (or the pieces of one utterance) may have
    # models with a depth transformer whose pass runs column by column (models/depth_columns.py): the engine pads it
    # to batch-size buckets and replays CUDA graphs of it, as of the backbone's decode step
    depth_columns = None

    def use_graphs(self, depth_sizes: list[int], codec_sizes: list[int], capture: bool) -> None:
        """engine/decode_graphs.py: pad the depth pass, and the codec where its shapes allow (a model that
        overrides this), to these batch-size buckets, replayed as CUDA graphs when capturing."""
        if self.depth_columns is not None:
            self.depth_columns.use_buckets(depth_sizes, capture)

    # --- preprocessing (CPU, off the engine thread) ---
    def check_text(self, text: Any, field: str = "text", allow_blank: bool = False) -> str:
        """What every model asks of a text before tokenizing it: a string, not blank, at most max_text_chars."""
        if not isinstance(text, str):
            raise InvalidRequest(f"{field} must be a string, got {type(text).__name__}", field=field)
        if not allow_blank and not text.strip():
            raise InvalidRequest(f"{field} is empty", field=field)
        if len(text) > self.max_text_chars:
            raise InvalidRequest(f"{field} is {len(text)} characters; the limit is {self.max_text_chars}",
                                 field=field)
        return text

    def prepare(
        self, text: str, voice: str | None = None, *, text_open: bool = False, **options
    ) -> list[int] | list[list[int]] | Prompt:
        """Prompt ids: one id per position, or (token_columns > 1) one row of token_columns ids per position;
        or a Prompt when the request also carries conditioning arrays or length rules. `text_open`
        (text_streaming models): `text` is the first piece and more will follow."""
        raise NotImplementedError

    def text_piece_ids(self, text: str) -> list[int]:
        """text_streaming models: the dual-track text ids of one piece (no template, no control ids)."""
        raise NotImplementedError

    # --- the next backbone input (engine thread; per-request state, no device work) ---
    def split_prompt(self, prompt: list, text_open: bool) -> tuple[list, Any]:
        """prepare()'s output -> (the positions to prefill, the request's input track: model state that
        `next_input` reads). By default every row is a position and there is no track."""
        return prompt, None

    def next_input(self, step: int | list[int], track: Any) -> int | list[int] | None:
        """The backbone input that follows a sampled step; None while the track waits for more input (open text).
        By default the step itself (Orpheus, CSM)."""
        return step

    def next_inputs(self, step: int | list[int] | None, track: Any) -> list | None:
        """The positions that follow a sampled step (step None: before the first one, for a track that waited at
        submission); None while the track waits for input. By default the one position of `next_input`. A model
        that feeds several positions after a step (CosyVoice2's bistream: 5 text tokens after a fill token, which
        is not fed itself) overrides this. Called again with the same step after the track was extended."""
        row = self.next_input(step, track)
        return None if row is None else [row]

    def waits_for_input(self, track: Any) -> bool:
        """Whether a request submitted with this track must wait for input (Engine.append_text) before its first
        sample, its prompt positions prefilled meanwhile."""
        return False

    def constrain_logits(self, logits: torch.Tensor, token_ids: torch.Tensor | None, tracks: list) -> torch.Tensor:
        """The candidate logits [B, C] of this step's sampled rows, with per-request rules that depend on the
        track applied (ids to exclude or to force); `tracks` is each row's. By default unchanged."""
        return logits

    def extend_track(self, track: Any, ids: list[int], final: bool) -> None:
        """Append queued ids (streamed text) to a request's track; `final` closes it."""
        raise InvalidRequest(f"{self.spec.name} does not take text after submission", field="text")

    def check_track_ids(self, ids: list[int]) -> list[int]:
        """Validated ids for extend_track (called on the caller's thread)."""
        raise InvalidRequest(f"{self.spec.name} does not take text after submission", field="text")

    def check_conditioning(self, conditioning: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Arrays as declared by `conditioning` (names, dtypes, ranks, fixed sizes) -> the arrays; raises
        InvalidRequest naming the field. Runs at submission, so a bad array never reaches the engine thread."""
        declared = {spec.arg: spec for spec in self.conditioning}
        unknown = set(conditioning) - set(declared)
        if unknown:
            raise InvalidRequest(f"{self.spec.name} takes no conditioning {sorted(unknown)}", field=sorted(unknown)[0])
        out = {}
        for arg, spec in declared.items():
            if arg not in conditioning:
                if spec.optional:
                    continue
                raise InvalidRequest(f"{arg} is required", field=arg)
            value = np.asarray(conditioning[arg])
            integer = spec.dtype.startswith("INT")
            if value.dtype.kind not in ("iu" if integer else "iuf") or value.ndim != len(spec.dims) or any(
                    d not in (-1, n) for d, n in zip(spec.dims, value.shape)):
                raise InvalidRequest(f"{arg} must be a {spec.dtype} array of shape {list(spec.dims)}, got "
                                     f"{value.dtype} {list(value.shape)}", field=arg)
            out[arg] = value
        return out

    def prompt_features(self, conditioning: dict[str, np.ndarray]) -> np.ndarray | None:
        """The vectors of a request's FEATURE prompt rows, [N, hidden] in prompt order, from its checked conditioning;
        None: the model takes none. Raises InvalidRequest naming the field. Runs at submission."""
        return None

    # The FEATURE vectors of an audio encoder: computed on the engine thread (on the engine's device), in one batch
    # for the requests admitted together, rather than at submit; the model counts a request's rows at submit.
    # Not with guidance.
    engine_features: bool = False

    def feature_count(self, conditioning: dict[str, np.ndarray]) -> int:
        """engine_features: how many FEATURE rows a request's checked conditioning fills. Raises InvalidRequest naming
        the field. Runs at submission."""
        raise NotImplementedError

    def encode_features(self, conditionings: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """engine_features: each request's FEATURE vectors [feature_count, hidden], on the model's device."""
        raise NotImplementedError

    def unconditioned_prompt(self, prompt: list) -> list:
        """spec.guidance: the unconditioned row's prompt positions, one per position of the checked prompt (after
        split_prompt; FEATURE rows where the prompt has them). By default the same."""
        return prompt

    def unconditioned_features(self, conditioning: dict[str, np.ndarray]) -> np.ndarray | None:
        """spec.guidance: the vectors of the unconditioned row's FEATURE rows; None (the default): the conditioned
        row's, which the engine then shares instead of computing them again."""
        return None

    def default_sampling(self) -> SamplingParams:
        return SamplingParams()

    # --- LM ---
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                features: PromptFeatures | None = None) -> torch.Tensor:
        """Flattened batch: input_ids [T] (or [T, token_columns]), positions [T] -> hidden states [T, hidden].
        `features` (only for models with prompt_features, only in batches that hold FEATURE rows): the vectors that
        are the inputs of those rows."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def candidate_logits(self, hidden: torch.Tensor,
                         codes_so_far: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the tokens that may come next, and their ids ([B, C] each, ids ascending per row; None =
        the whole vocab). `codes_so_far` is each row's codec code count, on the host: no device read-back.

        A model whose next token must come from a small set (Orpheus: one codebook's 4096 codes or the stop
        token) computes and samples only that set, which is exact and much cheaper than the full vocab.
        """
        return self.logits(hidden), None

    def depth_step(
        self, hidden: torch.Tensor, first: torch.Tensor, sample_column: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        """Models with a depth transformer: backbone hidden states [B, hidden] at the sampled rows and their sampled
        column-0 ids [B] -> the whole step [B, token_columns], which is also the next backbone input row. Runs
        on the device for the whole batch; `sample_column(logits [B, V], column) -> ids [B]` samples with each
        row's own parameters, seed and a step counter distinct per column."""
        raise NotImplementedError

    # --- generated steps -> stop test, codec codes ---
    def is_stop(self, step: int | list[int]) -> bool:
        """Whether a generated step (an id, or a row for token_columns > 1) ends the utterance."""
        return step in self.spec.stop_ids

    def ends(self, step: int | list[int], track: Any) -> bool:
        """is_stop for a request with this track (a track may make a stop id an ordinary step)."""
        return self.is_stop(step)

    def track_max_tokens(self, track: Any) -> int | None:
        """A length limit the track sets as its text arrives (a streamed text's length rule), or None. The engine
        ends the request ("length") at the smaller of it and the request's max_tokens."""
        return None

    # --- text out (a model that answers in text and speech: Step-Audio 2) ---
    text_output: bool = False  # the engine sends the reply's text as TEXT events, in order with the audio

    def is_text_id(self, step: int) -> bool:
        """text_output: whether a generated id is part of the reply's text (not audio, control or stop)."""
        return False

    def decode_text(self, ids: list[int]) -> str:
        """text_output: the text of the reply's text ids."""
        raise NotImplementedError

    def codes_from_step(self, step: int | list[int], codes_so_far: int) -> list[int]:
        """The codec codes one generated step contributes (empty for text, control or stop tokens)."""
        return []

    # --- codec ---
    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        """A batch of windows -> float32 audio per window (the samples to play, overlap already removed)."""
        raise NotImplementedError

    def windows_ready(self, state: Any, codes: list[int], lm_done: bool) -> int:
        """WindowSpec.scheduled_by_model: how many windows of this request can be decoded now, given all its codes
        so far and whether the LM has finished."""
        raise NotImplementedError

    def new_codec_state(self, conditioning: dict[str, np.ndarray]) -> Any:
        """A request's codec state, at admission; `conditioning` is its Prompt's (empty for most models)."""
        return None
