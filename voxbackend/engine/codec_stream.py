"""The codec on its own CUDA stream, beside the LM step (EngineConfig.overlap_codec).

The engine queues an LM step, decodes codec windows while the device runs it, then waits for the step's sampled
ids. The windows' codes are already on the host (earlier steps' ids), so the codec does not wait for this LM step:
its stream waits only for what was queued before the step (admission's new codec states), through an event
recorded just before the step is launched. Afterwards the LM's stream waits for the codec's (the device orders
them; the host does not block), so memory the codec used is not reused under it.

On a CPU there are no streams: the same calls check the order (an event is recorded before every codec run) and
do nothing else.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class CodecStream:
    def __init__(self, device: str):
        self.stream = torch.cuda.Stream(device) if device.startswith("cuda") else None
        self._before_lm: torch.cuda.Event | None = None
        self._marked = False

    def mark_before_lm(self) -> None:
        """Everything queued so far is what the codec may read; the LM step comes next."""
        if self.stream is not None:
            self._before_lm = torch.cuda.Event()
            self._before_lm.record()
        self._marked = True

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The codec's work of this step: on its stream, after the mark."""
        if not self._marked:
            raise RuntimeError("codec windows run without an event before the LM step (mark_before_lm)")
        self._marked = False
        if self.stream is None:
            yield
            return
        self.stream.wait_event(self._before_lm)
        with torch.cuda.stream(self.stream):
            yield
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream().wait_event(done)
