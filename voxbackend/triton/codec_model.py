"""`<model>_codec`: a model's codec as a stage of its own (docs/deploy.md, "The codec as its own model").

Triton places its instances (instance_group: another GPU, or several) and loads and unloads them; the engines of
the same server send it their windows over a local socket (codec_stage/local_socket.py says why not Triton
requests), and each instance decodes the windows of every engine in batches, most urgent first
(codec_stage/urgent_queue.py). A request's codec state travels with its windows, so any instance decodes any
window and nothing is left here when a request ends. Clients do not call it: a request gets an error naming this.
"""
from __future__ import annotations

import json

from voxbackend.codec_stage.local_socket import CodecServer, socket_dir
from voxbackend.codec_stage.urgent_queue import UrgentWindows
from voxbackend.triton.loading import DEFAULT_DRAIN_GRACE_S, model_parameters, resolve_checkpoint, resolve_device
from voxbackend.triton.pb_glue import route_logging, skip_interpreter_teardown

# how long the unload waits for the engines to leave: their drain grace, a text sequence's idle timeout, slack
ENGINE_LINGER_S = 10.0 + 5.0


class CodecModel:
    def initialize(self, args: dict) -> None:
        import torch
        import triton_python_backend_utils as pb_utils  # only importable inside the stub

        from voxbackend.models.registry import load_model

        self.pb = pb_utils
        route_logging(pb_utils)
        self.name = args["model_name"]
        params = model_parameters(json.loads(args["model_config"]))
        device = resolve_device(params.get("device") or "auto", args.get("model_instance_kind", "CPU"),
                                int(args.get("model_instance_device_id", 0) or 0))
        model_dir, codec_dir = resolve_checkpoint(params)
        model = load_model(model_dir, codec_dir, device, getattr(torch, params.get("dtype") or "float32"),
                           kind=params["model_kind"], lm=False)  # the codec and its rules, no LM weights
        self.grace_s = float(params.get("drain_grace_s") or DEFAULT_DRAIN_GRACE_S) + ENGINE_LINGER_S
        self._metrics(args.get("model_instance_name", "0"))
        self.windows = UrgentWindows(model, int(params.get("detok_batch") or 16), on_batch=self._observe).start()
        instance = args.get("model_instance_name", "0").replace("/", "_")
        self.server = CodecServer(socket_dir(self.name) / f"{instance}.sock", self.windows, device).start()
        pb_utils.Logger.log_info(f"{self.name}: codec stage up ({model.spec.name}, {model_dir}, {device}), "
                                 f"listening at {self.server.path}")

    def _metrics(self, instance: str) -> None:
        fam = self.pb.MetricFamily
        labels = {"model": self.name, "instance": instance}
        self.families = [  # kept alive: see metrics.py
            fam("voxbackend_codec_windows_total", "Codec windows this stage decoded", fam.COUNTER),
            fam("voxbackend_codec_batches_total", "Codec batches this stage decoded", fam.COUNTER),
            fam("voxbackend_codec_mixed_batches_total", "Codec batches that held windows of more than one engine",
                fam.COUNTER),
        ]
        self._windows, self._batches, self._mixed = (f.Metric(labels=labels) for f in self.families)

    def _observe(self, windows: int, engines: int) -> None:
        self._windows.increment(windows)
        self._batches.increment(1)
        if engines > 1:
            self._mixed.increment(1)

    def execute(self, requests):
        error = self.pb.TritonError(f"{self.name} takes its windows from the engines of this server, not requests")
        return [self.pb.InferenceResponse(error=error) for _ in requests]

    def finalize(self) -> None:
        if not self.server.wait_for_engines(self.grace_s):  # a drain: the engines' last windows come meanwhile
            self.pb.Logger.log_warn(f"{self.name}: {self.server.engines} engine(s) still connected at unload")
        self.server.close()
        self.windows.stop()
        skip_interpreter_teardown()
