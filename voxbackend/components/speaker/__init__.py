"""Speaker encoders: CAMPPlus (CosyVoice2) and ECAPA-TDNN (Qwen3-TTS Base)."""
