"""diffusers entry point of this mmspec pipeline folder (`mmspec.diffusers_folder`)."""
from image_ar.var.code import CoDePipeline  # noqa: F401
