"""GLM-4-Voice (THUDM): its speech tokenizer, 16 kHz speech to 12.5 ids a second (speech_tokenizer.py)."""
