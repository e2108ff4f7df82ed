"""What a backbone's settings require of its checkpoint, as the checkpoint's config files say.

Torch-free, so that one declaration serves both sides: a backbone refuses a setting its
transformer cannot honour when it loads (:mod:`jagg_pipeline.backbones.velocity`, from the
loaded transformer's config), and the workflow refuses the same setting before any job
(:mod:`jagg_pipeline.workflow.checks`, from ``transformer/config.json`` read as JSON). A new
refusal of this kind goes into :func:`option_problems`, and both sides apply it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jagg_pipeline.config.run import BackboneConfig

# A pipeline's transformer config, relative to the checkpoint (diffusers' layout).
TRANSFORMER_CONFIG = "transformer/config.json"
# The value FluxPipeline feeds a guidance embedding when none is set.
DEFAULT_GUIDANCE = 3.5


def guidance_embedded(transformer_config: Mapping[str, Any]) -> bool:
    """Whether a transformer config describes a guidance embedding (a guidance-distilled model).

    Flux-dev's and QwenImage's configs say so in ``guidance_embeds``; SD3's have no such key.
    """
    return bool(transformer_config.get("guidance_embeds", False))


def option_problems(
    spec: BackboneConfig, transformer_config: Mapping[str, Any], source: str
) -> list[str]:
    """The settings of ``spec`` that its checkpoint's transformer cannot honour, one line each.

    ``transformer_config``: the transformer's config (its ``config.json``, or a loaded model's
    ``config``); ``source``: that file, which each line names with the key. Empty: all fine.
    """
    problems = []
    if spec.guidance_scale is not None and not guidance_embedded(transformer_config):
        problems.append(
            f"{spec.key}.guidance_scale is set ({spec.guidance_scale}) but this {spec.family} "
            f"transformer has no guidance embedding ({source} has no guidance_embeds); for "
            f"classifier-free guidance set {spec.key}.cfg_scale"
        )
    return problems
