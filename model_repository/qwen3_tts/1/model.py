"""qwen3_tts: what clients call; runs qwen3_tts_preprocess and qwen3_tts_engine by BLS."""
from voxbackend.triton.front_model import FrontModel as TritonPythonModel  # noqa: F401
