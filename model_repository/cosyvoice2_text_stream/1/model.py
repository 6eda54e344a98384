"""cosyvoice2_text_stream: cosyvoice2's text in pieces (a Triton sequence), its audio on one stream."""
from voxbackend.triton.text_stream_model import TextStreamModel as TritonPythonModel  # noqa: F401
