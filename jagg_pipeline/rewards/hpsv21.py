"""HPSv2.1: open_clip ViT-H-14 + HPS v2.1 weights; cosine, no logit scale, in [-1, 1].

The architecture is built by open_clip on the meta device (shapes only: no random
initialisation, no memory) and the HPS checkpoint (the distributed ``HPS_v2.1_compressed.pt``,
weights under ``"state_dict"``, exactly the keys of hpsv2's vendored copy of open_clip) is
assigned to it, read straight onto the configured device; the only tensors the checkpoint lacks,
the text towers' causal attention masks, are rebuilt. Preprocessing reproduces HPS's
evaluation transform (``ResizeMaxSize``): longest side to the model's image size (bicubic,
antialiased), zero padding to a square with the extra pixel right/bottom, OpenAI mean/std.
``hpsv2.score()`` is never called: it downloads 3.9 GB on every first call.
Range [-1, 1]; real generations typically score 0.25-0.37.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from jagg_pipeline.config.run import HPSv21Config
from jagg_pipeline.config.sources import resolve_file
from jagg_pipeline.rewards.base import (
    BatchedReward,
    RewardConfigError,
    RewardFn,
    config_key,
    resolve_dtype,
)
from jagg_pipeline.rewards.clip import paired_cosine

NAME = "hpsv21"


SPEC = HPSv21Config  # the settings type, defined (torch-free) in jagg_pipeline.config.run


@dataclass
class OpenClipScorer:
    """An open_clip CLIP in eval mode with its tokenizer and HPS's preprocessing constants."""

    model: Any
    tokenizer: Callable[[list[str]], torch.Tensor]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def hps_preprocess(
    images: torch.Tensor,
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> torch.Tensor:
    """HPS's evaluation transform on a float [0, 1] batch [B, 3, H, W], on its device.

    Same operations and order as hpsv2's ``ResizeMaxSize`` after ``ToTensor``. One deliberate
    difference: HPS skips the padding when the longest side already equals ``size`` (and then
    fails on a non-square image); here such images are padded like all others.
    """
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import resize

    height, width = images.shape[-2:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        # Python's round, as HPS uses, so that sizes agree on .5 cases.
        new_h, new_w = round(height * scale), round(width * scale)
        images = resize(images, [new_h, new_w], InterpolationMode.BICUBIC, antialias=True)
        height, width = new_h, new_w
    pad_h, pad_w = size - height, size - width
    images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
    mean_t = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images - mean_t) / std_t


def hpsv21(scorer: OpenClipScorer, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """cos(image_i, prompt_i) of HPS's image and text features."""
    dtype = scorer.model.logit_scale.dtype
    device = scorer.model.logit_scale.device
    pixels = hps_preprocess(images.float(), scorer.image_size, scorer.mean, scorer.std)
    tokens = scorer.tokenizer(list(prompts)).to(device)
    image_features = scorer.model.encode_image(pixels.to(dtype))
    return paired_cosine(image_features, scorer.model.encode_text(tokens))


def _arch_name(arch: str) -> str:
    import open_clip

    key = config_key(NAME, "arch")
    if arch.endswith(".json"):
        path = Path(arch).expanduser()
        if not path.is_file():
            raise RewardConfigError(f"{key}: model-config file {arch} not found")
        open_clip.add_model_config(path)
        return path.stem
    if arch not in open_clip.list_models():
        raise RewardConfigError(
            f"{key}: {arch!r} is not an open_clip model name (e.g. 'ViT-H-14') nor a .json "
            "model-config path"
        )
    return arch


@contextmanager
def _quiet_random_init_warning() -> Iterator[None]:
    # open_clip warns "initialized randomly" when built without pretrained weights; here it is
    # built on the meta device (not initialised at all) and the HPS weights are assigned right
    # after, so the warning would only mislead.
    def keep(record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def _empty_model(arch: str) -> torch.nn.Module:
    """``arch`` with every tensor on the meta device: its shapes, no init, no memory."""
    import open_clip

    with _quiet_random_init_warning(), torch.device("meta"):
        return open_clip.create_model(arch, pretrained=None, device="meta")


def _rebuild_causal_masks(model: torch.nn.Module, arch: str) -> None:
    """Rebuild the non-persistent buffers a meta-built model still lacks after loading.

    open_clip's only ones are the text towers' causal attention masks (``attn_mask`` of
    ``CLIP``, ``TextTransformer``, ``MultimodalTransformer``): additive, -inf above the
    diagonal, exactly as their ``build_causal_mask`` fills them.
    """
    for module_name, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if not buffer.is_meta:
                continue
            if name != "attn_mask":
                where = f"{module_name}.{name}".lstrip(".")
                raise RewardConfigError(
                    f"{config_key(NAME, 'arch')}: {arch!r} has a buffer {where} that is not "
                    "in the checkpoint and not a causal mask this loader can rebuild; use an "
                    "architecture of open_clip's own towers (e.g. 'ViT-H-14')"
                )
            mask = torch.full(buffer.shape, float("-inf")).triu_(1)
            module.register_buffer(name, mask, persistent=False)


def load_open_clip(spec: HPSv21Config, device: torch.device) -> OpenClipScorer:
    """Build ``spec.arch`` from the HPS checkpoint alone, in ``spec.dtype`` on ``device``.

    No random initialisation and no float32 copy: the model is built on the meta device, the
    checkpoint is read onto ``device`` and assigned to it, and each tensor is then cast to the
    spec's dtype in place of the stored one. Scores are bit-identical to building the model
    randomly initialised and copying the weights into it.
    """
    import open_clip
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    dtype = resolve_dtype(NAME, spec.dtype)
    arch = _arch_name(spec.arch)
    key = config_key(NAME, "checkpoint")
    path = resolve_file(
        key,
        spec.checkpoint,
        "a local HPS_v2.1_compressed.pt (https://huggingface.co/xswu/HPSv2) or a hub "
        "'owner/name/file' such as xswu/HPSv2/HPS_v2.1_compressed.pt",
        RewardConfigError,
    )
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # torch raises several unrelated types for corrupt files
        raise RewardConfigError(f"{key}: {path} is not a loadable torch checkpoint: {err}") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise RewardConfigError(f"{key}: {path} has no 'state_dict' entry (HPS v2.1 format)")
    state = checkpoint.pop("state_dict")
    del checkpoint  # the model becomes the only owner of the weights: each cast frees its source
    model = _empty_model(arch)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as err:
        raise RewardConfigError(
            f"{key}: {path} does not match {config_key(NAME, 'arch')} = {spec.arch!r}: {err}"
        ) from err
    del state
    _rebuild_causal_masks(model, spec.arch)
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    size = model.visual.image_size
    return OpenClipScorer(
        model=model,
        tokenizer=open_clip.get_tokenizer(arch),
        image_size=size[0] if isinstance(size, (tuple, list)) else int(size),
        mean=OPENAI_DATASET_MEAN,
        std=OPENAI_DATASET_STD,
    )


def load(spec: HPSv21Config, device: torch.device) -> RewardFn:
    """Load the HPSv2.1 scorer named by ``spec`` onto ``device``."""
    scorer = load_open_clip(spec, device)
    return BatchedReward(
        NAME, partial(hpsv21, scorer), device, spec.batch_size, modules=[scorer.model]
    )
