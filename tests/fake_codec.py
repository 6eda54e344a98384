"""A tiny Llama with a fake stateful codec: every token is a code, windows of 2 frames, state counts windows."""
from __future__ import annotations

import numpy as np

from voxbackend.models.base import ModelSpec, WindowJob, WindowSpec
from voxbackend.models.token_lm import TokenLM


class FakeCodecLM(TokenLM):
    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.spec = ModelSpec(
            name="fake",
            geometry=self.spec.geometry,
            sample_rate=100,
            codes_per_frame=1,
            window=WindowSpec(frames=2, hop_frames=2, first_frames=2, flush_on_finish=True, stateful=True),
            stop_ids=(),
        )
        self.decoded: list[tuple[str, int, int, tuple[int, ...]]] = []  # (request, window, state before, codes)

    def codes_from_step(self, token, codes_so_far):
        return [token]

    def new_codec_state(self, conditioning):
        return 0

    def detokenize(self, jobs: list[WindowJob]) -> list[np.ndarray]:
        out = []
        for j in jobs:
            self.decoded.append((j.request_id, j.index, j.state, tuple(int(c) for c in j.codes.ravel())))
            j.state += 1
            out.append(np.full(10 * len(j.codes), j.index, dtype=np.float32))
        return out
