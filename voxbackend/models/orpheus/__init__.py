"""Orpheus TTS: Llama LM over SNAC codes; its SNAC decoder and its tiny-checkpoint writer."""
