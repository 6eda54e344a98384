"""CosyVoice2-0.5B: Qwen2 LM, zero-shot cloning front end, bistream text input and tiny writers; its
token2wav lives in voxbackend.components.flow_hift."""
