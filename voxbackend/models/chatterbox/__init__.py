"""Chatterbox (Resemble AI): T3 LM, S3Gen decoder, voice encoder."""
