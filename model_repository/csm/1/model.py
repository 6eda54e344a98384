"""csm: what clients call; runs csm_preprocess and csm_engine by BLS."""
from voxbackend.triton.front_model import FrontModel as TritonPythonModel  # noqa: F401
