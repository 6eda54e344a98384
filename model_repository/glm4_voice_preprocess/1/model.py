"""glm4_voice_preprocess: TEXT, glm4_voice's own inputs, sampling fields -> prompt ids, validated sampling."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
