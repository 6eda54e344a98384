"""Thin helpers over triton_python_backend_utils (passed in: it only exists inside the stub)."""
from __future__ import annotations

import atexit
import logging
import os
import sys

import numpy as np


def input_getter(pb_utils, request):
    """name -> numpy array, or None for an absent optional input (the shape fields.py expects)."""

    def get(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


def response(pb_utils, outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def error_response(pb_utils, message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonResponder:
    """streams.Responder over a decoupled model's response sender."""

    def __init__(self, pb_utils, sender):
        self._pb = pb_utils
        self._sender = sender

    def send(self, outputs: dict[str, np.ndarray] | None, error: str | None, final: bool) -> None:
        """outputs and error both None: only the final flag, no response."""
        pb = self._pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if outputs is None and error is None:
            self._sender.send(flags=flags)
            return
        r = error_response(pb, error) if error is not None else response(pb, outputs)
        self._sender.send(r, flags=flags)

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


class TritonLogHandler(logging.Handler):
    """Routes Python logging (the engine's and ours) into Triton's log."""

    def __init__(self, pb_utils, level: int = logging.INFO):
        super().__init__(level)
        self._logger = pb_utils.Logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = f"{record.name}: {self.format(record)}"
            if record.levelno >= logging.ERROR:
                self._logger.log_error(msg)
            elif record.levelno >= logging.WARNING:
                self._logger.log_warn(msg)
            else:
                self._logger.log_info(msg)
        except Exception:
            pass


def route_logging(pb_utils, name: str = "voxbackend") -> None:
    logger = logging.getLogger(name)
    if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
        logger.addHandler(TritonLogHandler(pb_utils))
        logger.setLevel(logging.INFO)
        logger.propagate = False


def skip_interpreter_teardown() -> None:
    """Call at the end of a model's finalize() (only the stub calls it): once the stub has cleaned up after it
    (shared memory included), its process ends without tearing down every Python module. That teardown (torch,
    transformers) took 1.5-4 s per stub on a loaded 2-core machine while Triton unloads a model's instances
    one after another, so a clean stop took 8-12 s, and the engine's stub crashed in it now and then (SIGSEGV).
    The OS frees the memory either way."""
    atexit.register(_exit_now)  # atexit runs first in interpreter shutdown, after the stub's own cleanup


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
            pass
    os._exit(0)
