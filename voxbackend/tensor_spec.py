"""One named request or response tensor: how a model declares its own request inputs, and how the serving
glue's fixed schema is written. Names and types follow Triton's config (TYPE_ prefix dropped)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config type without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    doc: str = ""
    # --- a model's own inputs only (SpeechModel.request_inputs): how they are handed to model.prepare ---
    arg: str = ""  # the prepare() keyword (or segment key) this input fills
    segment: str = ""  # set: one element per segment; prepare(<segment>=[{arg: value, ...}, ...])
    kind: str = ""  # "audio": BYTES audio files, or raw float32 when the segment's "rate" input is present
