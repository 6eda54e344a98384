"""Non-decoupled CPU model shared by every SpeechLM: float audio chunk -> requested encoding.

It reads only engine outputs (the decoupled-origin rule of ensembles), which is why the engine passes
AUDIO_FORMAT through. Each engine response, including the final one, passes through here once. A probe
(FINISH_REASON "probe") exists only to reach this step, where a cancelled ensemble shows
(request.is_cancelled(); see cancel_channel): it leaves as a response without tensors, which gives the
ensemble no output to send, so the client never sees it.
"""
from __future__ import annotations

import numpy as np

from voxbackend.triton.audio_encoding import encode
from voxbackend.triton.cancel_channel import send_cancel
from voxbackend.triton.pb_glue import error_response, input_getter, response, skip_interpreter_teardown
from voxbackend.triton.streams import PROBE

PASSED_THROUGH = ("SAMPLE_RATE", "CHUNK_INDEX", "FINAL", "FINISH_REASON", "SEED_USED")


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

    def execute(self, requests) -> None:
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            get = input_getter(pb, request)
            sender = request.get_response_sender()
            if request.is_cancelled():
                # the ensemble's client went away; Triton does not tell the running engine step (cancel_channel)
                send_cancel(_string(get("STREAM_ID")))
            if _string(get("FINISH_REASON")) == PROBE:
                sender.send(flags=final)  # no response: the ensemble has nothing to forward
                continue
            try:
                out = response(pb, self.outputs(get))
            except Exception as e:
                out = error_response(pb, f"audio postprocess failed: {type(e).__name__}: {e}")
            sender.send(out, flags=final)
        return None

    def finalize(self) -> None:
        skip_interpreter_teardown()
