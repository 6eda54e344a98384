"""Step-Audio 2 mini (speech in, text and speech out): the audio encoder (audio_encoder.py), the chat template
(chat.py), the front end, LM and codec wiring (model.py), token2wav and voices (codec.py) and the tiny checkpoint
(tiny.py). Runs in the engine; not served through Triton yet."""
