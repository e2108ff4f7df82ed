"""The encode stage: a prompt pool's conditioning, encoded once, by the text encoders alone.

Owns encoding a pool and what the sampling stages do with the result. :func:`run_encode`
loads only the text encoders and tokenizers of ``backbone.path`` (no transformer, no VAE:
``Backbone.load(text_only=True)``), encodes the pool's distinct prompts in batches of
``batch_size`` (a progress bar; one batch of activations on the device at a time) and the
negative prompt when ``backbone.cfg_scale > 1``, and writes the folder of
:mod:`jagg_pipeline.io.conditioning` with its config and manifest. Rollout and evaluate given
that folder (``--conditioning``) load their policy without text encoders and build each
round's conditioning from the pool's rows of its prompts (:func:`open_pool`), equal to what
encoding them inline gives (docs/backbones.md has where it is bit for bit).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jagg_pipeline.io.artifacts import BASE, METRICS_NAME, append_metrics
from jagg_pipeline.io.conditioning import (
    CONDITIONING_FILE,
    PROMPTS_FILE,
    STAGE,
    TEXT_FIELD,
    PoolConditioning,
    distinct,
    open_conditioning,
    text_keys,
    write_conditioning,
)
from jagg_pipeline.io.manifest import begin_output, finish_output, stage_inputs
from jagg_pipeline.io.prompts import resolve_prompts
from jagg_pipeline.support.startup import StageClock

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

# Prompts per text-encoder call: T5-XXL's activations for 32 prompts of 512 tokens are a few
# hundred MB, beside its 9.5 GB of weights.
BATCH_SIZE = 32


def run_encode(
    config: RunConfig,
    prompts: str | Path,
    out: str | Path,
    *,
    column: str | None = None,
    batch_size: int = BATCH_SIZE,
    progress: bool = True,
) -> Path:
    """The encode stage: ``out/conditioning.safetensors``, ``prompts.json``, config, manifest.

    ``prompts``: a prompt file or ``toy:train`` / ``toy:heldout`` (``column`` for tabular
    files), read before any model is loaded. The text encoders are read whatever
    ``backbone.load_text_encoders`` says.
    """
    from tqdm.auto import tqdm

    from jagg_pipeline.backbones import backbone_class

    clock = StageClock.start()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = Path(out)
    pool = distinct(resolve_prompts(prompts, column))
    spec = dataclasses.replace(config.backbone, load_text_encoders=True)
    backbone = backbone_class(spec.family).load(spec, text_only=True)
    out.mkdir(parents=True, exist_ok=True)
    begin_output(out, (CONDITIONING_FILE, PROMPTS_FILE, METRICS_NAME))
    clock.lap("load")
    start = time.perf_counter()
    batches = tqdm(
        backbone.encode_pool(pool, batch_size),
        total=math.ceil(len(pool) / batch_size),
        desc="encode",
        unit="batch",
        disable=None if progress else True,  # None: the bar only on a terminal
    )
    written = write_conditioning(out, pool, batches, backbone.encode_negative())
    clock.lap("work")
    metrics = {
        "prompts": len(pool),
        "bytes": written.stat().st_size,
        "seconds": time.perf_counter() - start,
        "time": clock.record(),
    }
    append_metrics(out, STAGE, None, 0, metrics)
    finish_output(
        out,
        config,
        stage=STAGE,
        inputs=stage_inputs(prompts, BASE),
        extra={
            "prompts": str(prompts),
            "column": column,
            "count": len(pool),
            TEXT_FIELD: text_keys(config),
        },
    )
    return out


def open_pool(config: RunConfig, conditioning: str | Path | None) -> PoolConditioning | None:
    """The pool a sampling stage reads its prompts' conditioning from (None: encoded inline).

    The folder is checked against ``config``
    (:func:`~jagg_pipeline.io.conditioning.open_conditioning`) before any model is loaded;
    the stage then loads its policy without text encoders.
    """
    return None if conditioning is None else open_conditioning(conditioning, config)


def conditioning_inputs(conditioning: str | Path | None) -> dict[str, Path]:
    """The manifest input of a sampling stage's ``--conditioning`` folder (none without it)."""
    return {} if conditioning is None else {"conditioning": Path(conditioning)}
