"""Rounds run as blocks and as single rounds, and how their results compare (test helper).

:func:`single_rounds` chains the rollout, score and train stages through their files, as the
workflow's single-round jobs do (the in-process loop); :func:`blocks` runs the same rounds as
blocks of K (:func:`jagg_pipeline.stages.block.run_block`), each block's last checkpoint the
next one's policy. :func:`checkpoint_files` and :func:`round_lines` are what must agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jagg_pipeline.io.artifacts import ROUND_STAGES, round_name, round_record

# Metric fields that measure time, which no two runs share.
TIMING = ("time.", "seconds")


def single_rounds(config: Any, workdir: Path) -> Path:
    """``train.rounds`` single rounds in ``workdir``; the last checkpoint."""
    from jagg_pipeline.stages.loop import run_rounds

    run_rounds(config, workdir, final_rollout=False)
    return workdir / round_name(config.train.rounds - 1) / "checkpoint"


def block_outputs(
    workdir: Path, first: int, last: int, keep: set[int] = frozenset(), evaluate: tuple = ()
):
    """The outputs of the block ``first..last`` in ``workdir``, as ``block`` lays them out.

    Its last checkpoint goes to round-<last>/checkpoint, its record beside it.
    """
    from jagg_pipeline.cli.block import block_outputs as layout

    folder = workdir / round_name(last)
    return layout(
        workdir,
        first,
        last,
        keep=sorted(keep),
        evaluate=evaluate,
        checkpoint=folder / "checkpoint",
        record=folder / "block.json",
    )


def encode_pool(config: Any, workdir: Path) -> Path:
    """The training prompts encoded once, as the workflow's encode job does."""
    from jagg_pipeline.stages.encode import run_encode

    out = workdir / "conditioning"
    if not (out / "manifest.json").is_file():
        run_encode(
            config, config.sampler.prompts, out, column=config.sampler.prompt_column, progress=False
        )
    return out


def blocks(config: Any, workdir: Path, size: int, keep: set[int] = frozenset()) -> Path:
    """``train.rounds`` rounds in blocks of ``size``; the last checkpoint."""
    from jagg_pipeline.stages.block import run_block

    conditioning = encode_pool(config, workdir)
    rounds, policy = config.train.rounds, "base"
    for first in range(0, rounds, size):
        last = min(first + size, rounds) - 1
        outputs = block_outputs(workdir, first, last, keep)
        run_block(
            config,
            policy,
            outputs,
            prompts=config.sampler.prompts,
            column=config.sampler.prompt_column,
            conditioning=conditioning,
            progress=False,
        )
        policy = str(outputs.rounds[last].checkpoint)
    return Path(policy)


def checkpoint_files(checkpoint: Path) -> dict[str, bytes]:
    """The weights and the trainer's state of a checkpoint, by relative path.

    The manifest, config and metric lines aside: they name their inputs and times.
    """
    return {
        str(path.relative_to(checkpoint)): path.read_bytes()
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.relative_to(checkpoint).parts[0] in ("policy", "trainer")
    }


def _untimed(line: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in line.items() if not k.startswith(TIMING)}


def round_lines(workdir: Path, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Every round's kept metric lines, timing fields aside, by ``round-<r>/<stage>``."""
    lines = {}
    for r in range(rounds):
        for stage in ROUND_STAGES:
            text = round_record(workdir / round_name(r), stage).read_text()
            lines[f"{round_name(r)}/{stage}"] = [
                _untimed(json.loads(row)) for row in text.splitlines()
            ]
    return lines
