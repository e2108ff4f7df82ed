"""jagg-pipeline: GRPO for text-to-image diffusion transformers, accelerated by JAGG."""

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("jagg-pipeline")
except PackageNotFoundError:
    # Run from a checkout on PYTHONPATH (the workflow's images): the version it declares, so
    # that a manifest written there equals one written by the installed package.
    _PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
    __version__ = tomllib.loads(_PYPROJECT.read_text())["project"]["version"]
