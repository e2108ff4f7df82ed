"""What every reward shares: the image convention, the reward callable, specs and loading errors.

Canonical input of every scorer: ``images`` a float tensor [B, 3, H, W] with values in [0, 1]
(any float dtype, any device) and ``prompts`` a sequence of B strings. Float in [0, 1] is what a
decoder produces before quantisation, so training scores exactly what it sampled; PIL images
and uint8 tensors (files, rollouts stored as uint8) go through :func:`to_unit_float` first,
which divides by 255 exactly as torchvision's ``ToTensor`` does. Every scorer returns a float32
tensor [B] on the device of ``images``, computed without grad.

Specs are plain dataclasses (defined in :mod:`jagg_pipeline.config.run`) whose fields name a
model's local path or hub id; their config key is ``rewards.<name>.<field>`` and every loading
error names that key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, get_args

import torch

from jagg_pipeline.config.fields import ConfigError, from_dict
from jagg_pipeline.config.run import RewardDtype

# The dtype names a spec accepts (config.RewardDtype, checked to agree) and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
if tuple(DTYPES) != get_args(RewardDtype):
    raise ImportError(f"reward DTYPES {tuple(DTYPES)} differ from config.RewardDtype")


class RewardConfigError(ConfigError):
    """A reward spec is malformed or names a model that cannot be found; names the config key."""


class RewardFn(Protocol):
    """``(images, prompts) -> tensor[B]``: float32, no grad, on the device of ``images``."""

    name: str

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


def config_key(reward: str, field: str) -> str:
    """The dotted config key of a spec field, used in every error message."""
    return f"rewards.{reward}.{field}"


def to_unit_float(images: torch.Tensor | Sequence[Any]) -> torch.Tensor:
    """Convert a uint8 tensor [B, 3, H, W] or a list of same-size PIL images to float [0, 1].

    Float tensors pass through unchanged (they are assumed to be in [0, 1] already).
    """
    if isinstance(images, torch.Tensor):
        if images.dtype == torch.uint8:
            return images.float().div_(255.0)
        if images.is_floating_point():
            return images
        raise TypeError(f"images must be uint8 or floating point, got {images.dtype}")
    import numpy as np

    arrays = [np.asarray(image.convert("RGB")) for image in images]
    sizes = {a.shape for a in arrays}
    if len(sizes) > 1:
        raise ValueError(f"images in one batch must share a size, got {sorted(sizes)}")
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return batch.float().div_(255.0)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float [0, 1] images rounded to uint8, as saving them to an image file would."""
    return (images.float() * 255.0).round().clamp(0, 255).to(torch.uint8)


def check_batch(images: torch.Tensor, prompts: Sequence[str]) -> None:
    """Reject inputs outside the canonical convention with a message that says what to do."""
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        kind = images.dtype if isinstance(images, torch.Tensor) else type(images).__name__
        raise TypeError(
            f"images must be a float tensor [B, 3, H, W] in [0, 1], got {kind}; "
            "convert uint8 tensors or PIL images with jagg_pipeline.rewards.to_unit_float"
        )
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape [B, 3, H, W], got {tuple(images.shape)}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        raise ValueError(
            f"need one prompt per image: {images.shape[0]} images, "
            f"{'a single string' if isinstance(prompts, str) else len(prompts)} prompts"
        )


def resolve_dtype(reward: str, name: str) -> torch.dtype:
    """The torch dtype a spec's ``dtype`` field names."""
    if name not in DTYPES:
        raise RewardConfigError(
            f"{config_key(reward, 'dtype')}: {name!r} is not one of {sorted(DTYPES)}"
        )
    return DTYPES[name]


class BatchedReward:
    """A scoring function bound to its model: chunks the batch, runs without grad, returns float32.

    ``score(images, prompts)`` receives a chunk already moved to ``device`` and returns one value
    per image; everything model-specific lives in that function, this class only applies the
    shared contract (input checks, chunking to bound memory, output dtype and device).
    ``modules``: the networks ``score`` runs (none for model-free rewards), for whoever
    reports what was loaded.
    """

    def __init__(
        self,
        name: str,
        score: Callable[[torch.Tensor, Sequence[str]], torch.Tensor],
        device: torch.device,
        batch_size: int,
        modules: Sequence[torch.nn.Module] = (),
    ) -> None:
        if batch_size < 1:
            raise RewardConfigError(
                f"{config_key(name, 'batch_size')}: must be >= 1, got {batch_size}"
            )
        self.name = name
        self.device = device
        self.batch_size = batch_size
        self.modules = tuple(modules)
        self._score = score

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_batch(images, prompts)
        prompts = list(prompts)
        chunks = []
        for start in range(0, images.shape[0], self.batch_size):
            stop = start + self.batch_size
            chunk = images[start:stop].to(self.device)
            chunks.append(self._score(chunk, prompts[start:stop]).float())
        return torch.cat(chunks).to(images.device)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, device={self.device}, batch={self.batch_size})"
        )


def spec_from_mapping(reward: str, spec_type: type, values: dict[str, Any]) -> Any:
    """Build a spec dataclass from a config mapping; unknown keys and wrong types are errors."""
    try:
        return from_dict(spec_type, values, prefix=f"rewards.{reward}")
    except ConfigError as err:
        raise RewardConfigError(str(err)) from None
