"""Non-decoupled CPU model: text, the model's own inputs (voice, speaker, context audio...) and sampling fields
-> prompt ids and validated sampling fields.

Tokenization and reference-audio encoding run here, in several instances, so they never run on the engine
thread. Bad input gets one error response naming the field.
"""
from __future__ import annotations

import json

import numpy as np

from voxbackend.errors import InvalidRequest
from voxbackend.triton import fields
from voxbackend.triton.pb_glue import error_response, input_getter, response, skip_interpreter_teardown
from voxbackend.models.base import as_prompt
from voxbackend.triton.loading import conditioning_specs, load_frontend, model_parameters, request_inputs


class PreprocessModel:
    """The TritonPythonModel of every `<model>_preprocess` folder."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        params = model_parameters(json.loads(args["model_config"]))
        self.inputs = request_inputs(params)
        self.conditioning = conditioning_specs(params)
        self.model = load_frontend(params)

    def outputs(self, get) -> dict[str, np.ndarray]:
        fmt = fields.audio_format(get)
        prompt = as_prompt(fields.prepare_request(get, self.model, self.inputs))
        sampling = prompt.limit(fields.sampling(get, self.model.default_sampling()))  # the model's length rules
        return {
            "PROMPT_IDS": fields.flat_prompt(prompt.ids),
            **fields.conditioning_tensors(prompt, self.conditioning),
            **fields.sampling_tensors(sampling),
            "AUDIO_FORMAT": np.array([fmt.encode()], dtype=np.object_),
            "CANCEL_PROBES": np.array([True]),  # for a BLS caller: the engine cannot see its client leave
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

    def finalize(self) -> None:
        skip_interpreter_teardown()
