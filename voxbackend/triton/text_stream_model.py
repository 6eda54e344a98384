"""Decoupled, sequence-batched Triton model: one utterance's text in pieces, its audio on one stream.

`<model>_text_stream` hosts its own engine (a sequence-batched model cannot be the front model's engine: Triton
refuses every request without a correlation id there). Triton's sequence batcher (direct strategy,
one slot per concurrent utterance: max_batch_size slots per instance) routes every piece of a sequence to the
instance that got its START, in order; the controls arrive as the inputs START, END, READY and CORRID. Slots a
batch does not fill come as null requests (READY 0), which get a bare final flag. Audio is sent encoded
(PCM16 or float32 bytes) like the front model's. See docs/text_streaming.md.
"""
from __future__ import annotations

import json
import threading
import time

from voxbackend.triton.engine_model import EngineModel
from voxbackend.triton.front_model import EncodedAudioResponder
from voxbackend.triton.pb_glue import input_getter
from voxbackend.triton.text_commit import check_normalizer
from voxbackend.triton.text_sequences import Piece, TextSequences

CONTROLS = ("START", "END", "READY", "CORRID")
DEFAULT_IDLE_US = 1_000_000  # Triton's own default when the config gives none


class BatchedAudioResponder(EncodedAudioResponder):
    """The engine stream's outputs as the front model sends them (encoded AUDIO bytes), with the batch dimension
    a max_batch_size > 0 model's outputs have."""

    def encode(self, outputs: dict) -> dict:
        return {k: v.reshape(1, -1) for k, v in super().encode(outputs).items()}


def _flag(get, name: str) -> bool:
    value = get(name)
    return bool(value is not None and value.size and value.reshape(-1)[0])


class TextStreamModel(EngineModel):
    """The TritonPythonModel of every `<model>_text_stream` folder."""

    def initialize(self, args: dict) -> None:
        super().initialize(args)
        if not getattr(self.model, "text_streaming", False):
            raise ValueError(f"{args['model_name']}: {self.model.spec.name} does not take text in pieces "
                             "(its model has no text_streaming)")
        check_normalizer(self.model.text_tokenizer)  # the commit rule's precondition: refuse to load otherwise
        batching = json.loads(args["model_config"]).get("sequence_batching") or {}
        idle_s = int(batching.get("max_sequence_idle_microseconds") or DEFAULT_IDLE_US) / 1e6
        self.sequences = TextSequences(self.engine, self.loop, self.inputs, idle_s, stream_id=self.cancels.stream_id)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="voxbackend-text-idle", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.sequences.expire_idle()
            except Exception as e:
                self.pb.Logger.log_error(f"idle watcher: {type(e).__name__}: {e}")

    def execute(self, requests) -> None:
        for request in requests:
            self._piece(request)
        return None

    def _piece(self, request) -> None:
        arrived = time.monotonic()
        raw = input_getter(self.pb, request)

        def get(name: str):  # one request of a batching model: drop the batch dimension
            value = raw(name)
            return None if value is None else value[0]

        responder = BatchedAudioResponder(self.pb, request.get_response_sender())
        self.drain.check()  # a stop that began since the last poll: a new sequence is refused at once
        if not _flag(get, "READY"):
            self.loop.reply(responder)  # a null request filling an idle slot
            return
        names = tuple(t.name() for t in request.inputs() if t.name() not in CONTROLS)
        corrid = get("CORRID")
        self.sequences.piece(Piece(int(corrid.reshape(-1)[0]) if corrid is not None else 0, _flag(get, "START"),
                                   _flag(get, "END"), get, names, responder, request.request_id() or "", arrived))

    def finalize(self) -> None:
        self._stop.set()
        super().finalize()
