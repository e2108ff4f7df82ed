"""jagg-pipeline: GRPO for text-to-image diffusion transformers, accelerated by JAGG."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("jagg-pipeline")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
