"""Decoupled `<model>`: what clients call. It hosts its own engine, prepares each request's prompt in-process (as
the engine model does for a direct client) and sends the audio encoded as the client asked (pcm16 or fp32 bytes).

Not an ensemble and not BLS (docs/triton.md, "Stopping"). Triton 2.51's ensemble turns every engine response
into a new request to the step after it, and a stopping server refuses new requests, so SIGTERM cut every
ensemble stream and then crashed the server. A model that called the preprocess and the engine by BLS drained,
but its stub died of heap corruption under load: Triton 2.51's Python backend builds every BLS response's numpy
arrays (and decodes its string tensors in Python) without holding the GIL, racing the model's own threads. A
stream here is one request of this model from admission to its last chunk: nothing internal to refuse, and the
client's cancellation shows in its own is_cancelled(). The cost: `<model>` and `<model>_engine` each hold an
engine (a deployment that does not call `<model>_engine` directly can leave that folder out).
"""
from __future__ import annotations

from voxbackend.triton.audio_encoding import client_outputs
from voxbackend.triton.engine_model import EngineModel
from voxbackend.triton.pb_glue import TritonResponder


class EncodedAudioResponder(TritonResponder):
    """The engine's float chunks as a client gets them: AUDIO as bytes in the stream's AUDIO_FORMAT."""

    def encode(self, outputs: dict) -> dict:
        return client_outputs(outputs)

    def send(self, outputs, error, final):
        super().send(None if outputs is None else self.encode(outputs), error, final)


class FrontModel(EngineModel):
    """The TritonPythonModel of every `<model>` folder that clients call."""

    responder = EncodedAudioResponder
