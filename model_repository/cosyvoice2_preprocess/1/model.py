"""cosyvoice2_preprocess: TEXT, cosyvoice2's own inputs, sampling fields -> prompt ids, validated sampling."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
