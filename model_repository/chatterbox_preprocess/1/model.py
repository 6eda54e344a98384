"""chatterbox_preprocess: TEXT, chatterbox's own inputs, sampling fields -> prompt ids, validated sampling."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
