"""diffusers entry point of this mmspec pipeline folder (`mmspec.diffusers_folder`)."""
from image_ar.llamagen.pipeline import LlamaGenPipeline  # noqa: F401
