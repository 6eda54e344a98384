"""glm4_voice_engine: one voxbackend engine per instance (settings: config.pbtxt parameters)."""
from voxbackend.triton.engine_model import EngineModel as TritonPythonModel  # noqa: F401
