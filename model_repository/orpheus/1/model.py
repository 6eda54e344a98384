"""orpheus: what clients call; runs orpheus_preprocess and orpheus_engine by BLS."""
from voxbackend.triton.front_model import FrontModel as TritonPythonModel  # noqa: F401
