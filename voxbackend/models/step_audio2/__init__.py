"""Step-Audio 2 mini (speech in, text and speech out). Not served yet: so far its audio encoder and adapter
(audio_encoder.py), which turn a user's clip into the LM's prompt rows."""
