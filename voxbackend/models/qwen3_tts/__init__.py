"""Qwen3-TTS-12Hz: talker + code predictor, its front end, voice cloning, its 12 Hz codec and tiny writers."""
