"""chatterbox_turbo_preprocess: TEXT, chatterbox_turbo's own inputs, sampling fields -> prompt ids, validated sampling."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
