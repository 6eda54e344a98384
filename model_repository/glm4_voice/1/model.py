"""glm4_voice: what clients call; hosts its own engine and sends encoded audio."""
from voxbackend.triton.front_model import FrontModel as TritonPythonModel  # noqa: F401
