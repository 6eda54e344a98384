"""Engine settings. Every field can be set from `voxbackend.load(**options)` or a Triton config parameter."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POLICIES = ("online", "fcfs", "offline", "voxserve")  # voxserve: VoxServe's own policy, for ablation
CPU_PACE_FLOOR = 1.6  # what detok_pace_floor "auto" means on a CPU


@dataclass
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    policy: str = "online"  # online (streaming-aware) | fcfs | offline | voxserve (ablation)
    max_batch: int = 32  # requests in one LM step
    kv_pages: int = 1024  # pages in the KV pool (one more is kept as scratch for padding)
    page_size: int = 16  # tokens per KV page
    prefill_budget: int = 512  # tokens per LM step across chunked prefills and decodes
    max_queue: int = 256  # waiting requests beyond this are refused as overloaded
    detok_batch: int = 16  # codec windows per detokenizer call
    playback_margin_s: float = 1.0  # online policy: extra buffer beyond the last chunk before a stream is "pressing"
    detok_margin_s: float = 0.15  # online policy: decode a stream's windows once its buffer is below this
    # online policy: near the machine's limit (the streams' average pace, audio made per second since their first
    # chunk, below this x real time, and a full codec batch forming within 0.3 s) serve the LM in arrival order and
    # decode only full batches, as offline does; 0: never. "auto": 1.6 on a CPU, where each codec call has a large
    # fixed cost (measured), 0 elsewhere (on a device whose LM alone makes streams barely faster than the floor it
    # costs streams at low load, in the simulation; not measured on a GPU): docs/scheduling.md
    detok_pace_floor: str = "auto"
    first_chunk_s: float = 0.0  # hold a stream's first audio until it is this long (0: send the first window at once)
    attention: str = "auto"  # auto | torch | flashinfer
    # decode steps padded to batch-size buckets in static buffers (engine/decode_graphs.py). graphs: captured as
    # CUDA graphs and replayed (CUDA with FlashInfer attention); padded: the same path run eagerly, on any device
    # (what the CPU tests run); off; auto: graphs where they can be captured, else off
    cuda_graphs: str = "auto"
    # decode codec windows on their own CUDA stream while the device runs the LM step (engine/codec_stream.py):
    # on | off | auto (on for CUDA; off on a CPU, where the two cannot run at once and windows would lag a step)
    overlap_codec: str = "auto"
    # server-side cap on a request's max_tokens (LM steps); above it a request is refused. 0: the model's
    # official maximum (ModelSpec.max_tokens)
    max_tokens_limit: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.pace_floor < 0:
            raise ValueError(f"detok_pace_floor must be >= 0 or 'auto', got {self.detok_pace_floor!r}")
        if self.detok_margin_s < 0:
            raise ValueError(f"detok_margin_s must be >= 0, got {self.detok_margin_s}")
        for name in ("max_batch", "kv_pages", "page_size", "prefill_budget", "max_queue", "detok_batch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if int(self.max_tokens_limit) < 0:
            raise ValueError(f"max_tokens_limit must be >= 0 (0 = the model's maximum), got {self.max_tokens_limit}")
        if self.attention not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"attention must be auto, torch or flashinfer, got {self.attention!r}")
        if self.cuda_graphs not in ("auto", "graphs", "padded", "off"):
            raise ValueError(f"cuda_graphs must be auto, graphs, padded or off, got {self.cuda_graphs!r}")
        if self.overlap_codec not in ("auto", "on", "off"):
            raise ValueError(f"overlap_codec must be auto, on or off, got {self.overlap_codec!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def pace_floor(self) -> float:
        """detok_pace_floor as a number ("auto" resolved for this config's device)."""
        if self.detok_pace_floor == "auto":
            return CPU_PACE_FLOOR if self.device == "cpu" else 0.0
        try:
            return float(self.detok_pace_floor)
        except ValueError:
            raise ValueError(f"detok_pace_floor must be a number or 'auto', got {self.detok_pace_floor!r}") from None

    @property
    def overlaps_codec(self) -> bool:
        return self.overlap_codec == "on" or (self.overlap_codec == "auto" and self.device.startswith("cuda"))

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch  # lazily: light processes (postprocess, clients) import voxbackend without torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_options(cls, options: dict) -> "EngineConfig":
        """Build from loose options (strings from config files are converted to each field's type)."""
        known = {f.name: f for f in fields(cls)}
        unknown = set(options) - set(known)
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}; known: {sorted(known)}")
        values = {}
        for name, value in options.items():
            kind = type(getattr(cls(), name))
            values[name] = kind(value) if not isinstance(value, kind) else value
        return cls(**values)
