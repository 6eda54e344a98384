"""step_audio2_preprocess: TEXT, step_audio2's own inputs, sampling fields -> prompt ids, validated sampling."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
