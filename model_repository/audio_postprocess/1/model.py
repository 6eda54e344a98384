"""audio_postprocess: float audio chunk -> PCM16 or float32 bytes (shared by every model)."""
from voxbackend.triton.postprocess_model import PostprocessModel as TritonPythonModel  # noqa: F401
