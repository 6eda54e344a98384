"""Non-decoupled CPU model shared by every SpeechLM: float audio chunk -> requested encoding.

It reads only engine outputs (the decoupled-origin rule of ensembles), which is why the engine passes
AUDIO_FORMAT through. Each engine response, including the final one, passes through here once.
"""
from __future__ import annotations

import numpy as np

from voxbackend.triton.audio_encoding import encode
from voxbackend.triton.cancel_channel import send_cancel
from voxbackend.triton.pb_glue import error_response, input_getter, response

PASSED_THROUGH = ("SAMPLE_RATE", "CHUNK_INDEX", "FINAL", "FINISH_REASON")


def _string(value: np.ndarray | None) -> str:
    if value is None or value.size == 0:
        return ""
    item = value.reshape(-1)[0]
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)


class PostprocessModel:
    """The TritonPythonModel of `audio_postprocess`."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils

    def outputs(self, get) -> dict[str, np.ndarray]:
        data = encode(get("AUDIO"), _string(get("AUDIO_FORMAT")))
        return {"AUDIO": np.array([data], dtype=np.object_), **{name: get(name) for name in PASSED_THROUGH}}

    def execute(self, requests) -> list:
        pb = self.pb
        responses = []
        for request in requests:
            if request.is_cancelled():
                # the ensemble's client went away; Triton does not tell the running engine step (cancel_channel)
                send_cancel(_string(input_getter(pb, request)("STREAM_ID")))
            try:
                out = self.outputs(input_getter(pb, request))
                responses.append(response(pb, out))
            except Exception as e:
                responses.append(error_response(pb, f"audio postprocess failed: {type(e).__name__}: {e}"))
        return responses
