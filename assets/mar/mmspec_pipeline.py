"""diffusers entry point of this mmspec pipeline folder (`mmspec.diffusers_folder`)."""
from continuous.mar.cspd import CSpDPipeline  # noqa: F401
