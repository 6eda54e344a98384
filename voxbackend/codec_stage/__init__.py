"""The codec as a stage of its own (a `<model>_codec` Triton model): engines send it codec windows over a local
socket, and it decodes windows of every engine in one urgency-ordered batch. Nothing here knows Triton."""
