"""Triton Python-backend glue: knows the request schema and Triton, not any one SpeechLM.

    schema.py            tensor names/types (source of truth for configs and models)
    configs.py           renders model_repository/*/config.pbtxt (`python -m voxbackend.triton.configs`)
    engine_model.py      decoupled `<model>_engine`: one engine per instance, execute() only enqueues
    streams.py           the single response thread: sends chunks, polls cancellation, ends every stream
    cancel_channel.py    ensemble cancellation back to the engine instance (Triton 2.51 does not forward it)
    preprocess_model.py  `<model>_preprocess`: text/voice/sampling -> prompt ids (CPU, several instances)
    postprocess_model.py `audio_postprocess`: float chunk -> PCM16/float32 bytes (shared)
    fields.py            request tensors -> validated values; audio_encoding.py: sample encodings
    metrics.py           Prometheus families via pb_utils.MetricFamily
    loading.py           config parameters -> engine / front end; default checkpoint
    server.py            the launcher: find tritonserver, backend dir with the right stub, start/wait/stop
    fake_engine.py       weights-free Engine stand-in for glue tests and fault injection
"""
