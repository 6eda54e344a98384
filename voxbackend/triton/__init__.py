"""Triton Python-backend glue, only what the Triton stub loads: knows the request schema and Triton, not any one
SpeechLM. The repository generator and the launcher live in voxbackend.deploy.

    schema.py            tensor names/types (source of truth for configs and models)
    front_model.py       decoupled `<model>` that clients call: the engine model, its audio encoded
    engine_model.py      decoupled `<model>_engine`: one engine per instance, execute() only enqueues
    streams.py           the single response thread: sends chunks, polls cancellation, ends every stream
    cancel_channel.py    a BLS caller's cancellation, the launcher's SHUTDOWN, to an engine instance
    drain.py             noticing that the server is stopping (SIGTERM), for the drain grace period
    preprocess_model.py  `<model>_preprocess`: text/voice/sampling -> prompt ids (CPU, several instances)
    fields.py            request tensors -> validated values; audio_encoding.py: sample encodings
    metrics.py           Prometheus families via pb_utils.MetricFamily
    loading.py           config parameters -> engine / front end; default checkpoint
    text_stream_model.py `<model>_text_stream`: one utterance's text in pieces (a Triton sequence), one stream
    text_sequences.py    the pieces of one sequence -> one engine request; text_commit.py: which ids are final
    pb_glue.py           thin helpers over triton_python_backend_utils

The weights-free engine double for glue tests and fault injection is voxbackend.testing.fake_engine.
"""
