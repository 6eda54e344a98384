"""Clients for a voxbackend Triton server: tts_stream (one request -> WAV) and loadgen (open-loop load)."""
