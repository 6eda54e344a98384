"""Mimi (Kyutai): the streaming decoder, the encoder and their weight loading; used by CSM and Qwen3-TTS."""
