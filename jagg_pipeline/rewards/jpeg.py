"""JPEG compressibility (DDPO): minus the JPEG size in kB, in (-inf, 0]; prompt ignored.

Model-free; the prompt is ignored. Images are rounded to uint8 (exact for images that came
from uint8 files) and encoded by Pillow at ``quality``. Range (-inf, 0]: higher means more
compressible (flatter) images. Runs on the CPU whatever the images' device.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from functools import partial

import torch

from jagg_pipeline.config.run import JpegCompressibilityConfig
from jagg_pipeline.rewards.base import BatchedReward, RewardFn, to_uint8

NAME = "jpeg_compressibility"

# Encoding is per image on the CPU, so chunking only bounds the uint8 copy held at once.
_CHUNK = 256


SPEC = (
    JpegCompressibilityConfig  # the settings type, defined (torch-free) in jagg_pipeline.config.run
)


def jpeg_kilobytes(images: torch.Tensor, quality: int) -> torch.Tensor:
    """Size in kB (1000 bytes) of each float [0, 1] image encoded as a JPEG at ``quality``."""
    from PIL import Image

    arrays = to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(
    quality: int, images: torch.Tensor, prompts: Sequence[str]
) -> torch.Tensor:
    """-kB of each image's JPEG encoding; ``prompts`` are ignored."""
    return -jpeg_kilobytes(images, quality)


def load(spec: JpegCompressibilityConfig, device: torch.device) -> RewardFn:
    """The reward; ``device`` is ignored (encoding happens on the CPU).

    ``spec.quality`` is bounded to Pillow's useful range [1, 95] by the spec's field (checked
    when the config is read, and by :func:`~jagg_pipeline.rewards.registry.load_reward`).
    """
    return BatchedReward(
        NAME, partial(jpeg_compressibility, spec.quality), torch.device("cpu"), _CHUNK
    )
