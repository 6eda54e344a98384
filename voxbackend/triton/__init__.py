"""Triton Python-backend glue: knows the request schema and Triton, not any one SpeechLM.

    schema.py            tensor names/types (source of truth for configs and models)
    configs.py           renders model_repository/*/config.pbtxt (`python -m voxbackend.triton.configs`)
    front_model.py       decoupled `<model>` that clients call: preprocess and engine by BLS, encodes the audio
    engine_model.py      decoupled `<model>_engine`: one engine per instance, execute() only enqueues
    streams.py           the single response thread: sends chunks, polls cancellation, ends every stream
    cancel_channel.py    the front model's client cancellation to the engine instance (BLS cannot cancel in 2.51)
    drain.py             noticing that the server is stopping (SIGTERM), for the drain grace period
    preprocess_model.py  `<model>_preprocess`: text/voice/sampling -> prompt ids (CPU, several instances)
    fields.py            request tensors -> validated values; audio_encoding.py: sample encodings
    metrics.py           Prometheus families via pb_utils.MetricFamily
    loading.py           config parameters -> engine / front end; default checkpoint
    server.py            the launcher: find tritonserver, backend dir with the right stub, start/wait/stop
    fake_engine.py       weights-free Engine stand-in for glue tests and fault injection
"""
