"""Step-Audio 2 mini (speech in, text and speech out): the audio encoder (audio_encoder.py), the chat template
(chat.py), the LM with text out (model.py) and the tiny checkpoint (tiny.py). Not served through Triton yet: it has
no speech out (token2wav) so far."""
