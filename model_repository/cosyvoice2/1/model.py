"""cosyvoice2: what clients call; runs cosyvoice2_preprocess and cosyvoice2_engine by BLS."""
from voxbackend.triton.front_model import FrontModel as TritonPythonModel  # noqa: F401
