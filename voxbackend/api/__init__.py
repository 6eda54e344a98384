"""An OpenAI-compatible speech API over the Triton model repository (app.py): speech, audio chat with conversation
models (chat.py), a WebSocket for incremental text, and a browser player (static/). A client of tritonserver: it
never loads a model."""
