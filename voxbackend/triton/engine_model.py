"""Decoupled Triton model hosting one voxbackend engine per instance.

execute() only parses, submits and returns; the engine runs on its own thread and hands events to the single
response thread (streams.ResponseLoop), which sends chunks, polls cancellation and ends every stream.
Nothing here knows which SpeechLM it serves: prompt building and defaults come from engine.model.
"""
from __future__ import annotations

import json
import time
import uuid

from voxbackend.codec_stage.local_socket import SocketCodecClient, socket_dir
from voxbackend.errors import EngineDead, EngineOverloaded, InvalidRequest
from voxbackend.triton import fields
from voxbackend.triton.cancel_channel import CancelListener
from voxbackend.triton.drain import DrainWatch
from voxbackend.models.base import Prompt, as_prompt
from voxbackend.triton.loading import (DEFAULT_DRAIN_GRACE_S, conditioning_specs, instance_settings, load_engine,
                                       model_parameters, request_inputs)
from voxbackend.triton.metrics import TritonMetrics
from voxbackend.triton.pb_glue import TritonResponder, input_getter, route_logging, skip_interpreter_teardown
from voxbackend.triton.schema import DEFAULT_AUDIO_FORMAT
from voxbackend.triton.streams import ResponseLoop, Stream


class EngineModel:
    """The TritonPythonModel of every `<model>_engine` folder."""

    responder = TritonResponder  # the engine's float chunks as they are (front_model.py encodes them)

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # only importable inside the stub

        self.pb = pb_utils
        route_logging(pb_utils)
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError(f"{args['model_name']} must set model_transaction_policy {{ decoupled: true }}")
        params = model_parameters(config)
        self.inputs = request_inputs(params)
        self.conditioning = conditioning_specs(params)
        settings = instance_settings(
            params, args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0) or 0))
        self.engine = load_engine(settings)
        self.codec_stage = None
        if params.get("codec_model"):  # the codec runs as its own model (codec_model.py)
            self.codec_stage = SocketCodecClient(socket_dir(params["codec_model"]), self.engine.config.device)
            self.engine.use_codec_stage(self.codec_stage)
        self.model = self.engine.model
        self.sample_rate = int(self.model.spec.sample_rate)
        self.metrics = TritonMetrics(pb_utils, args["model_name"], args.get("model_instance_name", "0"))
        self.loop = ResponseLoop(self.engine, self.metrics)
        self.loop.start()
        self.cancels = CancelListener(self.loop.request_cancel, self._server_stopping)
        self.engine.start()
        grace_s = float(params.get("drain_grace_s") or DEFAULT_DRAIN_GRACE_S)
        self.drain = DrainWatch(lambda: self.loop.request_drain(grace_s))
        pb_utils.Logger.log_info(
            f"{args['model_name']}: engine up ({self.model.spec.name}, {settings.checkpoint}, "
            f"{settings.engine_options}{', codec: ' + params['codec_model'] if self.codec_stage else ''})")

    def execute(self, requests) -> None:
        for request in requests:
            self._enqueue(request)
        return None  # decoupled: responses go through the response thread

    def _enqueue(self, request) -> None:
        arrived = time.monotonic()
        request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
        get = input_getter(self.pb, request)
        try:
            fmt = fields.audio_format(get)
        except InvalidRequest:
            fmt = DEFAULT_AUDIO_FORMAT  # reported below, once the stream exists
        responder = self.responder(self.pb, request.get_response_sender())
        stream = Stream(request_id, responder, fmt, arrived, self.sample_rate,
                        stream_id=self.cancels.stream_id(request_id),
                        text_output=getattr(self.model, "text_output", False))
        self.drain.check()  # a stop that began since the last poll: refuse this one too (before add: see below)
        self.loop.add(stream)
        # from here until submit is a race with the loop's housekeeping (a dead engine fails the stream with a
        # plainer message than EngineDead): keep it short
        if self.loop.closing or self.loop.draining:
            return  # the server is stopping: the loop ends the stream at once
        try:
            fields.audio_format(get)
            ids = fields.prompt_ids(get, self.model.spec.token_columns)
            if ids is None:  # a direct client: prepare here (Triton's thread, not the engine's)
                prompt = as_prompt(fields.prepare_request(get, self.model, self.inputs))
            else:  # from the preprocess: its conditioning arrays travel beside the ids
                prompt = Prompt(ids, fields.conditioning(get, self.conditioning))
            sampling = fields.sampling(get, self.model.default_sampling())  # draws the seed when absent
            stream.seed, stream.probes = sampling.seed, fields.cancel_probes(get)
            try:
                self.engine.submit(prompt, sampling, self.loop.on_event, request_id=request_id)
            except InvalidRequest as e:  # the engine names its own fields (max_tokens); the client sent tensors
                raise fields.for_client(e, self.inputs + self.conditioning) from None
        except (InvalidRequest, EngineOverloaded, EngineDead) as e:
            self.loop.reject(request_id, f"{type(e).__name__}: {e}")
        except Exception as e:  # never raise out of execute: the stream would never end
            self.loop.reject(request_id, f"internal error: {type(e).__name__}: {e}")

    def _server_stopping(self) -> None:
        """The launcher's SHUTDOWN (cancel_channel): end every stream now and stop the engine; finalize() may
        come much later (or never, for a model Triton keeps alive for a leaked request)."""
        self.loop.request_shutdown()
        self.engine.shutdown()
        if self.codec_stage is not None:
            self.codec_stage.close()

    def finalize(self) -> None:
        self.drain.close()
        self.cancels.close()
        self.loop.stop("the model is being unloaded")
        self.engine.shutdown()
        if self.codec_stage is not None:
            self.codec_stage.close()  # the codec stage's unload waits for this
        skip_interpreter_teardown()
