"""The run layout: where a run and each of its outputs live, spelled once.

A run is ``<results>/<experiment>/<variant>/seed-<s>/`` (:func:`run_directory`; its id, the
part below ``<results>``, is :func:`run_id`). Inside it: ``config.yaml`` and ``overrides.yaml``
(written before any job), a folder per training round (``round-<r>/``, named by
:func:`~jagg_pipeline.io.artifacts.round_name`) holding its ``scores``, its metric lines
(``metrics/<stage>.jsonl``) and, when the round keeps them, its ``checkpoint`` and ``rollout``;
a round that keeps neither holds them under ``round-<r>/transient/`` until the next round no
longer needs them (:mod:`jagg_pipeline.workflow.retention` decides which). A block of rounds
(``workflow.rounds_per_job``) leaves its record in its last round's folder. Evaluations are
``eval/trained-<n>/``. Next to the runs: each experiment's ``summary/`` and ``tracking/``, the
prompt pools encoded once (``<results>/conditioning/<pool>/``) and the toy world
(``workflow.toyworld.root``: ``<root>/<family>``, ``<root>/clip``).

The rules' output patterns are these functions applied to wildcard names (``"{seed}"``), so a
path and its pattern cannot disagree. Pure string functions, torch-free.
"""

from __future__ import annotations

from pathlib import Path

from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.io.artifacts import ROUND_PREFIX, ROUND_RECORDS, evaluation_name, round_name

SEED_PREFIX = "seed-"
EVALUATIONS = "eval"
TRANSIENT = "transient"
CONDITIONING = "conditioning"
SUMMARY = "summary"
TRACKING = "tracking"
COMPARISON = "comparison"
# A block's record: block.json when its last round keeps its checkpoint, else the record of
# the rule block_transient (two rules, since a temp() output is a property of the rule).
BLOCK_RECORD = "block.json"
BLOCK_TRANSIENT_RECORD = "block-transient.json"


def run_id(experiment: str, variant: str, seed: int | str) -> str:
    """``<experiment>/<variant>/seed-<s>``: a run's folder below the results, and its id."""
    return f"{experiment}/{variant_seed(variant, seed)}"


def variant_seed(variant: str, seed: int | str) -> str:
    """``<variant>/seed-<s>``: a run within its experiment (the summary's and tracker's name)."""
    return f"{variant}/{SEED_PREFIX}{seed}"


def run_directory(results: str, experiment: str, variant: str, seed: int | str) -> str:
    """The folder of a run under ``results`` (``workflow.results``)."""
    return f"{results}/{run_id(experiment, variant, seed)}"


def round_pattern(run: str) -> str:
    """A round's folder under ``run`` as a pattern of the wildcard ``round`` (four digits)."""
    return f"{run}/{ROUND_PREFIX}{{round}}"


def round_folder(run: str, round_index: int) -> str:
    """``round-<r>/`` of the run folder ``run``."""
    return f"{run}/{round_name(round_index)}"


def stage_folder(run: str, round_index: int, stage: str, kept: bool) -> str:
    """Where round ``round_index`` keeps ``stage`` (``checkpoint``, ``rollout``).

    In its folder when the round is kept, else under its ``transient/``.
    """
    folder = round_folder(run, round_index)
    return f"{folder}/{stage}" if kept else f"{folder}/{TRANSIENT}/{stage}"


def round_record(run_round: str, stage: str) -> str:
    """The kept metric lines of ``stage`` in the round folder (or pattern) ``run_round``."""
    return f"{run_round}/{ROUND_RECORDS}/{stage}.jsonl"


def scores_folder(run: str, round_index: int) -> str:
    """The scores of round ``round_index`` (kept by every round)."""
    return f"{round_folder(run, round_index)}/scores"


def evaluation_folder(run: str, trained: int) -> str:
    """The evaluation of the policy after ``trained`` rounds of the run folder ``run``."""
    return f"{run}/{EVALUATIONS}/{evaluation_name(trained)}"


def block_record(run: str, last_round: int, kept: bool) -> str:
    """The record of the block ending with ``last_round``.

    ``block.json``, or ``block-transient.json`` when that round keeps no checkpoint.
    """
    name = BLOCK_RECORD if kept else BLOCK_TRANSIENT_RECORD
    return f"{round_folder(run, last_round)}/{name}"


def conditioning_folder(results: str, pool: str) -> str:
    """Where the prompt pool ``pool`` (its key) is encoded once."""
    return f"{results}/{CONDITIONING}/{pool}"


def experiment_folder(results: str, experiment: str, part: str) -> str:
    """An experiment's own folder ``part`` (:data:`SUMMARY`, :data:`TRACKING`) beside its runs."""
    return f"{results}/{experiment}/{part}"


def comparison_folder(results: str, experiment: str) -> str:
    """An experiment's comparison page, read back from the tracker."""
    return f"{results}/{COMPARISON}/{experiment}"


def toyworld_inputs(config: RunConfig, root: str) -> dict[str, str]:
    """The toy-world builds (under ``root``, ``workflow.toyworld.root``) a config points at.

    ``toy_backbone`` when ``backbone.path`` is ``<root>/<family>``, ``toy_clip`` when a
    reward or metric in use is ``toy_clipscore`` with its model at ``<root>/clip``; nothing
    for real checkpoints.
    """
    inputs = {}
    backbone = Path(config.backbone.path)
    if backbone.parent == Path(root) and backbone.name == config.backbone.family:
        inputs["toy_backbone"] = str(backbone)
    used = {*config.rewards.weights, *config.eval.metrics}
    if "toy_clipscore" in used and Path(config.rewards.toy_clipscore.model) == Path(root, "clip"):
        inputs["toy_clip"] = f"{root}/clip"
    return inputs
