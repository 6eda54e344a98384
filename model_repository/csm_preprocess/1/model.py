"""csm_preprocess: text, speaker, context segments (text + audio), sampling fields -> prompt rows (flattened)."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
