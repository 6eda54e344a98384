"""Non-decoupled CPU model: text, voice and sampling fields -> prompt ids and validated sampling fields.

Tokenization runs here, in several instances, so it never runs on the engine thread. Bad input gets one
error response naming the field.
"""
from __future__ import annotations

import json

import numpy as np

from voxbackend.errors import InvalidRequest
from voxbackend.triton import fields
from voxbackend.triton.pb_glue import error_response, input_getter, response
from voxbackend.triton.loading import load_frontend, model_parameters


class PreprocessModel:
    """The TritonPythonModel of every `<model>_preprocess` folder."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model = load_frontend(model_parameters(json.loads(args["model_config"])))

    def outputs(self, get) -> dict[str, np.ndarray]:
        text, voice = fields.text_and_voice(get)
        fmt = fields.audio_format(get)
        ids = self.model.prepare(text, voice)
        sampling = fields.sampling(get, self.model.default_sampling())
        return {
            "PROMPT_IDS": np.asarray(ids, dtype=np.int64),
            **fields.sampling_tensors(sampling),
            "AUDIO_FORMAT": np.array([fmt.encode()], dtype=np.object_),
        }

    def execute(self, requests) -> list:
        pb = self.pb
        responses = []
        for request in requests:
            try:
                out = self.outputs(input_getter(pb, request))
                responses.append(response(pb, out))
            except InvalidRequest as e:
                responses.append(error_response(pb, f"InvalidRequest: {e}"))
            except Exception as e:  # never raise out of execute
                responses.append(error_response(pb, f"internal error: {type(e).__name__}: {e}"))
        return responses
