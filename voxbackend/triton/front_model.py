"""Decoupled front model `<model>`: what clients call. It runs `<model>_preprocess` and `<model>_engine` by BLS
and sends the engine's audio, encoded, on the client's own stream.

Not an ensemble (docs/triton.md, "Stopping"): Triton 2.51's ensemble turns every engine response into a new
request to the step after it, and a stopping server refuses new requests, so SIGTERM cut every ensemble stream
and then crashed the server. Here a stream makes two internal requests, both at admission (the preprocess, then
one decoupled engine request), and none per chunk, so a draining server finishes it.

The client's request is this model's own, so its cancellation shows in is_cancelled() at once; the engine hears
of it through the cancel channel (the engine's STREAM_ID comes with its first response: a probe while the stream
waits in the queue). One thread per stream waits on its engine responses; one thread sends every response and
polls cancellation (sends from many threads crashed the Python backend stub).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from voxbackend.triton.audio_encoding import client_outputs
from voxbackend.triton.cancel_channel import send_cancel
from voxbackend.triton.drain import DRAINING
from voxbackend.triton.loading import conditioning_specs, model_parameters
from voxbackend.triton.pb_glue import TritonResponder, route_logging, skip_interpreter_teardown
from voxbackend.triton.schema import ENGINE_OUTPUTS, preprocess_outputs
from voxbackend.triton.streams import ERROR_PREFIX, PROBE

log = logging.getLogger("voxbackend.triton")
STOPPING = "Server is stopping"  # Triton's refusal of a new request once the server began to stop


def client_error(message: str) -> str:
    """An internal request's error as the client sees it; a refusal because the server is stopping says so."""
    if STOPPING in message:
        return f"{DRAINING} ({message})"
    return message


def tensor_string(value: np.ndarray | None) -> str:
    if value is None or value.size == 0:
        return ""
    item = value.reshape(-1)[0]
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)


@dataclass
class FrontStream:
    responder: TritonResponder
    engine_stream: str = ""  # the engine's STREAM_ID, once its first response came
    cancelled: bool = False  # the client went away
    cancel_sent: bool = False
    closed: bool = False  # the final response was posted


class FrontModel:
    """The TritonPythonModel of every `<model>` folder that clients call."""

    cancel_check_s = 0.1  # is_cancelled() is an IPC round trip per stream: not more often

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        route_logging(pb_utils)
        params = model_parameters(json.loads(args["model_config"]))
        self.preprocess, self.engine = params["preprocess_model"], params["engine_model"]
        self.preprocess_outputs = [s.name for s in preprocess_outputs(conditioning_specs(params))]
        self.engine_outputs = [s.name for s in ENGINE_OUTPUTS]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[int, FrontStream] = {}  # the sender thread's own: streams not yet ended
        # kept on the model: a collected family breaks its metrics (metrics.py)
        self._family = pb_utils.MetricFamily("voxbackend_front_streams", "Client streams open in this front model "
                                             "(the launcher waits for 0 before it stops the server)",
                                             pb_utils.MetricFamily.GAUGE)
        self._gauge = self._family.Metric(labels={"model": args["model_name"],
                                                  "instance": args.get("model_instance_name", "0")})
        self._stopped = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="voxbackend-front-send", daemon=True)
        self._sender.start()

    def execute(self, requests) -> None:
        for request in requests:
            stream = FrontStream(TritonResponder(self.pb, request.get_response_sender()))
            self._outbox.put(("open", stream))
            threading.Thread(target=self._serve, args=(request, stream), name="voxbackend-front-stream",
                             daemon=True).start()
        return None  # decoupled: responses go through the sender thread

    # --- one thread per stream ---
    def _serve(self, request, stream: FrontStream) -> None:
        try:
            pre = self.pb.InferenceRequest(model_name=self.preprocess, inputs=self._own(request.inputs()),
                                           requested_output_names=self.preprocess_outputs).exec()
            if pre.has_error():
                return self._post(stream, None, client_error(pre.error().message()), final=True)
            if stream.cancelled:
                return self._post(stream, None, None, final=True)
            engine = self.pb.InferenceRequest(model_name=self.engine, inputs=self._own(pre.output_tensors()),
                                              requested_output_names=self.engine_outputs)
            for response in engine.exec(decoupled=True):
                if response.has_error():
                    return self._post(stream, None, client_error(response.error().message()), final=True)
                tensors = {t.name(): t.as_numpy() for t in response.output_tensors()}
                if not tensors:
                    continue  # a bare final flag: the loop ends after it
                stream.engine_stream = stream.engine_stream or tensor_string(tensors["STREAM_ID"])
                self._pass_cancel(stream)
                reason = tensor_string(tensors["FINISH_REASON"])
                if reason == PROBE:
                    continue
                if reason.startswith(ERROR_PREFIX):
                    return self._post(stream, None, reason[len(ERROR_PREFIX):], final=True)
                final = bool(tensors["FINAL"].reshape(-1)[0])
                self._post(stream, client_outputs(tensors), None, final)
                if final:
                    return
            self._post(stream, None, None, final=True)  # the engine ended with a bare final flag
        except Exception as e:  # noqa: BLE001 - never leave the client's stream open
            self._post(stream, None, client_error(f"internal error: {type(e).__name__}: {e}"), final=True)

    def _own(self, tensors) -> list:
        """Copies of another request's or response's tensors: passing them on as they are (views of their shared
        memory) crashed this stub with a double free (client_outputs says when)."""
        return [self.pb.Tensor(t.name(), np.array(t.as_numpy(), copy=True)) for t in tensors]

    def _post(self, stream: FrontStream, outputs, error: str | None, final: bool) -> None:
        if not stream.closed:
            stream.closed = final
            self._outbox.put(("send", stream, outputs, error, final))

    def _pass_cancel(self, stream: FrontStream) -> None:
        """Tell the engine once, when both the client's cancellation and the engine's stream id are known."""
        if stream.cancelled and stream.engine_stream and not stream.cancel_sent:
            stream.cancel_sent = True
            send_cancel(stream.engine_stream)

    # --- the sender thread ---
    def _send_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                item = self._outbox.get(timeout=self.cancel_check_s)
            except queue.Empty:
                item = None
            try:
                while item is not None:
                    self._handle(item)
                    item = self._outbox.get_nowait() if not self._outbox.empty() else None
                self._check_cancelled()
            except Exception:  # noqa: BLE001 - the thread must live: every open stream depends on it
                log.exception("front sender error")

    def _handle(self, item: tuple) -> None:
        if item[0] == "open":
            self._open[id(item[1])] = item[1]
            self._gauge.set(len(self._open))
        else:
            self._send(*item[1:])

    def _send(self, stream: FrontStream, outputs, error: str | None, final: bool) -> None:
        try:
            stream.responder.send(outputs, error, final)
        except Exception as e:  # noqa: BLE001 - a client that went away must not stop the others
            log.warning("front send failed: %s", e)
        if final:
            self._open.pop(id(stream), None)
            self._gauge.set(len(self._open))

    def _check_cancelled(self) -> None:
        for stream in list(self._open.values()):
            if not stream.cancelled:
                try:
                    stream.cancelled = bool(stream.responder.is_cancelled())
                except Exception:  # noqa: BLE001
                    continue
            self._pass_cancel(stream)

    def finalize(self) -> None:
        self._stopped.set()
        self._sender.join(2.0)
        skip_interpreter_teardown()
