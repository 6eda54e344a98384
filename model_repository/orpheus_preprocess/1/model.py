"""orpheus_preprocess: text, voice, sampling fields -> prompt ids and validated sampling fields."""
from voxbackend.triton.preprocess_model import PreprocessModel as TritonPythonModel  # noqa: F401
