"""An experiment's comparison: every run's stage metrics in one table, the curves, the verdict.

Reads only finished outputs of the run layout (:mod:`jagg_pipeline.workflow.layout`): each
round's
kept metric lines ``round-<r>/metrics/{rollout,score,train}.jsonl`` (:func:`read_run`; training
reward of the round's rollout, one line per optimizer step) and
``eval/trained-<n>/`` (held-out metrics after n rounds: ``metrics.jsonl``, ``metrics.json``). Writes
``metrics.jsonl`` (every line of every run, tagged with experiment, variant and seed: the table
the tracking rule pushes), ``table.md`` (per variant, mean +- std over seeds: evaluation base
-> final, rise, training reward, update-stage seconds per round; a variant of one seed shows
its values alone; below it, per stage, the median seconds of a job's start-up, loading and
work, :mod:`jagg_pipeline.support.startup`; numbers by
:func:`~jagg_pipeline.io.tables.format_number`, never ``-0.000``) and ``curves.png``
(evaluation metrics and training reward vs round, seed bands; integer round ticks; a panel
only for what was measured, at most 3 to a row) and ``grids/`` (the evaluation grids of the
base policy and the final checkpoint of every run). A run is read whole or not at all: a round
or an evaluation its config calls for but its folder lacks is an error naming what is missing
(:func:`read_run`), never a curve with a point quietly gone. Torch-free.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jagg_pipeline.config.fields import digest
from jagg_pipeline.io.artifacts import (
    EVALUATION_FOLDER,
    METRICS_NAME,
    ROUND_FOLDER,
    ROUND_STAGES,
    atomic_output,
    atomic_write_text,
    evaluated_rounds,
    evaluation_name,
    make_folder,
    round_name,
    round_record,
)
from jagg_pipeline.io.figures import (
    note_figure,
    panel_grid,
    round_ticks,
    save_figure,
    variant_colours,
)
from jagg_pipeline.io.tables import format_number, markdown_table
from jagg_pipeline.support.errors import InputError
from jagg_pipeline.support.startup import PARTS
from jagg_pipeline.workflow.layout import SEED_PREFIX

UPDATE_PARTS = ("forward", "backward", "optimizer")
# The stages that run as jobs, in pipeline order: the rows of the start-up table.
JOB_STAGES = ("rollout", "score", "train", "evaluate")
NO_CURVES = "No evaluations and no rollouts in these runs: nothing to plot against rounds."


@dataclass
class RunMetrics:
    """What one run's folders say: per-round lines and evaluations by rounds trained."""

    variant: str
    seed: int
    lines: list[dict[str, Any]] = field(default_factory=list)
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    grids: dict[int, Path] = field(default_factory=dict)
    # The run's jagg.mode ("" when unknown): which approximation its probes are read for.
    mode: str = ""
    # Digest of its config but the gradient engine and the seeds (:func:`setting_digest`):
    # runs with equal settings differ only in how their gradients are computed.
    setting: str = ""

    def stage(self, name: str) -> list[dict[str, Any]]:
        """The metric lines of stage ``name`` in round order."""
        return [line for line in self.lines if line["stage"] == name]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise InputError(
                f"{path}:{number}: not a JSON metrics line ({err.msg}); the file is damaged: "
                "delete it and rerun the workflow target, which rebuilds it"
            ) from None
    return lines


def _indices(folder: Path, pattern: re.Pattern[str]) -> list[int]:
    """The numbers of the sub-folders of ``folder`` whose names match ``pattern``."""
    if not folder.is_dir():
        return []
    found = (pattern.fullmatch(p.name) for p in folder.iterdir() if p.is_dir())
    return sorted(int(match.group(1)) for match in found if match)


def _expected(directory: Path, config: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The rounds and evaluations (rounds trained) the run in ``directory`` must hold.

    A training run (round folders, or an evaluation after training) holds every round of its
    config's ``train.rounds`` and every evaluation that ``eval.every`` calls for, whatever is
    on disk. An evaluation run (no rounds) and a folder without a config.yaml (the in-process
    loop's, whose last round may be scored and not trained) hold the ones found.
    """
    rounds = _indices(directory, ROUND_FOLDER)
    evaluations = _indices(directory / "eval", EVALUATION_FOLDER)
    if not config or not (rounds or any(n > 0 for n in evaluations)):
        return rounds, evaluations
    # Imported here: the config dataclasses are needed only for a training run's shape.
    from jagg_pipeline.config.fields import from_dict
    from jagg_pipeline.config.run import RunConfig

    resolved = from_dict(RunConfig, config, source=str(directory / "config.yaml"))
    rounds = resolved.train.rounds
    return list(range(rounds)), evaluated_rounds(rounds, resolved.eval.every)


def _missing(path: Path, what: str, directory: Path) -> InputError:
    return InputError(
        f"{path}: missing ({what} of the run in {directory}, which its config.yaml calls "
        "for); rerun the workflow target (snakemake TARGET), which rebuilds it, rather than "
        "summarise the run without it"
    )


def setting_digest(config: Mapping[str, Any]) -> str:
    """The digest of a resolved config without its ``jagg`` section and its seeds."""
    rest = {key: value for key, value in config.items() if key != "jagg"}
    for section in ("train", "eval"):
        if isinstance(rest.get(section), Mapping):
            rest[section] = {k: v for k, v in rest[section].items() if k != "seed"}
    return digest(rest)


def read_run(directory: str | Path, variant: str, seed: int) -> RunMetrics:
    """The metrics of the run in ``directory`` (every round and evaluation found there).

    A round's lines come from its kept records only, ``round-<r>/metrics/<stage>.jsonl``
    (:func:`~jagg_pipeline.io.artifacts.round_record`, stages rollout, score, train): the
    workflow and :mod:`jagg_pipeline.stages.loop` copy each stage folder's metrics.jsonl there, and
    the stage folders themselves may be gone (``workflow.keep_every``).

    A training run is read whole (:func:`_expected`): a round folder, a round's record or an
    evaluation that its config calls for and the folder lacks raises
    :class:`~jagg_pipeline.support.errors.InputError` naming it; rounds or evaluations beyond the
    config (left by an earlier, longer run in the same folder) are not read.
    """
    directory = Path(directory)
    run = RunMetrics(variant, seed)
    config: dict[str, Any] = {}
    if (directory / "config.yaml").is_file():
        config = yaml.safe_load((directory / "config.yaml").read_text()) or {}
        run.mode = str((config.get("jagg") or {}).get("mode", ""))
        run.setting = setting_digest(config)
    rounds, evaluations = _expected(directory, config)
    whole = bool(config)  # without a config, nothing says what the folder should hold
    for round_index in rounds:
        round_dir = directory / round_name(round_index)
        if not round_dir.is_dir():
            raise _missing(round_dir, f"round {round_index}", directory)
        for stage in ROUND_STAGES:
            path = round_record(round_dir, stage)
            if path.is_file():
                run.lines.extend(_jsonl(path))
            elif whole:
                raise _missing(path, f"the {stage} metrics of round {round_index}", directory)
    for trained in evaluations:
        eval_dir = directory / "eval" / evaluation_name(trained)
        if not (eval_dir / "metrics.json").is_file():
            if whole:
                raise _missing(eval_dir, f"the evaluation after {trained} rounds", directory)
            continue
        if (eval_dir / METRICS_NAME).is_file():  # older evaluations wrote metrics.json only
            run.lines.extend(_jsonl(eval_dir / METRICS_NAME))
        report = json.loads((eval_dir / "metrics.json").read_text())
        run.evaluations[trained] = {name: v["mean"] for name, v in report["metrics"].items()}
        run.grids[trained] = eval_dir / "grid.png"
    return run


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def mean_pm_std(mean: float, std: float, seeds: int, spec: str = ".3f") -> str:
    """``mean +- std`` of ``seeds`` values in format ``spec``; one seed: the value alone.

    A single seed has no spread to report: ``+- 0.000`` would read as a measured zero.
    """
    text = format_number(mean, spec)
    return text if seeds < 2 else f"{text} +- {format_number(std, spec.lstrip('+'))}"


def _update_seconds(run: RunMetrics) -> dict[str, float]:
    """Mean update-stage seconds per round, split into forward, backward and optimizer."""
    per_round: dict[int, dict[str, float]] = {}
    for line in run.stage("train"):
        parts = per_round.setdefault(line["round"], dict.fromkeys(UPDATE_PARTS, 0.0))
        for part in UPDATE_PARTS:
            parts[part] += line.get(f"time.{part}") or 0.0
    if not per_round:
        return dict.fromkeys(UPDATE_PARTS, float("nan"))
    return {p: statistics.mean(r[p] for r in per_round.values()) for p in UPDATE_PARTS}


def summarise(runs: Sequence[RunMetrics]) -> dict[str, Any]:
    """Per variant (in first-seen order): evaluation curves, base/final/rise, reward, timing."""
    by_variant: dict[str, list[RunMetrics]] = {}
    for run in runs:
        by_variant.setdefault(run.variant, []).append(run)
    summary: dict[str, Any] = {}
    for variant, seeds in by_variant.items():
        evaluated = sorted(set.intersection(*(set(r.evaluations) for r in seeds)))
        metrics = sorted({m for r in seeds for e in r.evaluations.values() for m in e})
        curves = {
            m: [mean_std([r.evaluations[k][m] for r in seeds]) for k in evaluated] for m in metrics
        }
        reward_rounds = sorted(
            set.intersection(*({x["round"] for x in r.stage("score")} for r in seeds))
        )
        rewards = [
            mean_std(
                [next(x for x in r.stage("score") if x["round"] == k)["total_mean"] for r in seeds]
            )
            for k in reward_rounds
        ]
        updates = [_update_seconds(r) for r in seeds]
        first, last = (evaluated[0], evaluated[-1]) if evaluated else (None, None)
        summary[variant] = {
            "seeds": [r.seed for r in seeds],
            "evaluated_rounds": evaluated,
            "curves": curves,
            "base": {m: curves[m][0] for m in metrics} if evaluated else {},
            "final": {m: curves[m][-1] for m in metrics} if evaluated else {},
            "rise": {
                m: mean_std([r.evaluations[last][m] - r.evaluations[first][m] for r in seeds])
                for m in metrics
            }
            if evaluated
            else {},
            "reward_rounds": reward_rounds,
            "train_reward": rewards,
            "update_seconds": {p: statistics.mean(u[p] for u in updates) for p in UPDATE_PARTS},
        }
    return summary


def table(summary: Mapping[str, Any]) -> str:
    """:func:`table_cells` as markdown."""
    return markdown_table(*table_cells(summary))


def table_cells(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(head, rows) of a table: one row per variant, metrics base -> final, rise, timing.

    Final and rise are mean +- std over the variant's seeds (the ``seeds`` column); a variant
    of one seed shows its values without a +-. Evaluation runs (no training: one evaluation
    each) get one column per metric instead.
    """
    metrics = sorted({m for s in summary.values() for m in s["final"]})
    if not any(s["train_reward"] or len(s["evaluated_rounds"]) > 1 for s in summary.values()):
        return _evaluation_cells(summary, metrics)
    head = ["variant", "seeds", *(f"{m}: base -> final (rise)" for m in metrics)]
    head += ["train reward: first -> last round", "update s/round (fwd + bwd + opt)"]
    rows = []
    for variant, s in summary.items():
        cells = [variant, str(len(s["seeds"]))]
        for m in metrics:
            if m not in s["final"]:
                cells.append("-")
                continue
            (base, _), (final, final_std) = s["base"][m], s["final"][m]
            rise, rise_std = s["rise"][m]
            seeds = len(s["seeds"])
            cells.append(
                f"{format_number(base)} -> {mean_pm_std(final, final_std, seeds)} "
                f"({mean_pm_std(rise, rise_std, seeds, '+.3f')})"
            )
        rewards = s["train_reward"]
        cells.append(
            f"{format_number(rewards[0][0])} -> {format_number(rewards[-1][0])}" if rewards else "-"
        )
        u = {part: format_number(value, ".2f") for part, value in s["update_seconds"].items()}
        total = format_number(sum(s["update_seconds"].values()), ".2f")
        cells.append(f"{total} ({u['forward']} + {u['backward']} + {u['optimizer']})")
        rows.append(cells)
    return head, rows


def _evaluation_cells(
    summary: Mapping[str, Any], metrics: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """One row per evaluated variant: each metric's mean (+- std over seeds)."""
    rows = []
    for variant, s in summary.items():
        seeds = len(s["seeds"])
        cells = [mean_pm_std(*s["final"][m], seeds) if m in s["final"] else "-" for m in metrics]
        rows.append([variant, str(seeds), *cells])
    return ["variant", "seeds", *metrics], rows


def stage_seconds(runs: Sequence[RunMetrics]) -> dict[str, dict[str, Any]]:
    """Per stage: its jobs and their median import, load and work seconds (None: unmeasured).

    A job is a line with ``time.load`` (train: its first step's); the medians are over every
    job of ``runs``. Import is measured in ``python -m jagg_pipeline`` processes only.
    """
    stages: dict[str, dict[str, Any]] = {}
    for stage in JOB_STAGES:
        jobs = [line for run in runs for line in run.stage(stage) if "time.load" in line]
        if not jobs:
            continue
        stages[stage] = {"jobs": len(jobs)}
        for part in PARTS:
            values = [job[f"time.{part}"] for job in jobs if job.get(f"time.{part}") is not None]
            stages[stage][part] = statistics.median(values) if values else None
    return stages


def stage_table(stages: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown of :func:`stage_seconds` (after a blank line), or "" when no job recorded any.

    The overhead is import + load; its share is of import + load + work ("-" where import
    was not measured).
    """
    if not stages:
        return ""
    rows = []
    for stage, s in stages.items():
        cells = ["-" if s[part] is None else format_number(s[part], ".2f") for part in PARTS]
        share = "-"
        if s["import"] is not None:
            overhead = s["import"] + s["load"]
            share = format_number(overhead / (overhead + s["work"]), ".0%")
        rows.append([stage, str(s["jobs"]), *cells, share])
    head = ["stage", "jobs", "import s", "load s", "work s", "overhead share"]
    return (
        "\nStart-up: median seconds per job (import: process start to the stage; load: inputs "
        "and models; work: sampling, scoring, training).\n\n" + markdown_table(head, rows)
    )


def plot(summary: Mapping[str, Any], path: str | Path, title: str = "") -> Path:
    """One panel per evaluation metric plus the rollout reward, vs round, with seed bands.

    A panel only for what some variant measured (an evaluation-only experiment has no
    rollout reward; runs without evaluations no held-out panels), at most 3 to a row; a
    figure that says so when there is nothing at all. Rounds are ticked at whole numbers. A
    variant of one seed has no band; when no variant has more than one, the legend says n=1
    instead of mean +- std. A variant has one colour in every panel.
    """
    metrics = sorted({m for s in summary.values() for m, points in s["curves"].items() if points})
    panels = {
        f"held-out {m}": (
            "rounds trained",
            {v: (s["evaluated_rounds"], s["curves"].get(m, [])) for v, s in summary.items()},
        )
        for m in metrics
    }
    if any(s["train_reward"] for s in summary.values()):
        panels["rollout reward"] = (
            "round",
            {v: (s["reward_rounds"], s["train_reward"]) for v, s in summary.items()},
        )
    if not panels:
        return save_figure(note_figure([NO_CURVES]), path)
    figure, axes = panel_grid(len(panels))
    colours = variant_colours(summary)
    several = any(len(s["seeds"]) > 1 for s in summary.values())
    legend: dict[str, Any] = {}
    for axis, (name, (xlabel, series)) in zip(axes, panels.items(), strict=True):
        drawn: list[int] = []
        for variant, (xs, points) in series.items():
            if not points:
                continue
            single = len(summary[variant]["seeds"]) < 2
            label = f"{variant} (n=1)" if single and several else variant
            mean = [p[0] for p in points]
            (line,) = axis.plot(xs, mean, marker="o", markersize=3, color=colours[variant])
            legend.setdefault(label, line)
            drawn += xs
            if not single:
                low = [p[0] - p[1] for p in points]
                high = [p[0] + p[1] for p in points]
                axis.fill_between(xs, low, high, color=colours[variant], alpha=0.15)
        axis.set(title=name, xlabel=xlabel)
        round_ticks(axis, drawn)
        axis.grid(alpha=0.3)
    # Every variant in one legend, whichever panels it has points in.
    axes[0].legend(
        legend.values(),
        legend.keys(),
        title="mean +- std over seeds" if several else "one seed each (n=1)",
        fontsize=8 if len(legend) > 3 else None,
    )
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return save_figure(figure, path)


def write_summary(
    runs: Mapping[str, tuple[str | Path, str, int]], out: str | Path, title: str = ""
) -> dict[str, Any]:
    """Summarise ``runs`` (run id -> (directory, variant, seed)) into the folder ``out``."""
    read = {run_id: read_run(*spec) for run_id, spec in runs.items()}  # refused: nothing written
    out = make_folder(out)
    tagged = [
        {"run": run_id, "variant": run.variant, "seed": run.seed, **line}
        for run_id, run in read.items()
        for line in run.lines
    ]
    atomic_write_text(out / METRICS_NAME, "".join(json.dumps(line) + "\n" for line in tagged))
    grids = make_folder(out / "grids")
    for run in read.values():
        for trained in sorted(run.grids)[:1] + sorted(run.grids)[-1:]:
            name = f"{run.variant}_{SEED_PREFIX}{run.seed}_{evaluation_name(trained)}.png"
            with atomic_output(grids / name) as tmp:
                shutil.copyfile(run.grids[trained], tmp)
    summary = summarise(list(read.values()))
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    markdown = table(summary) + stage_table(stage_seconds(list(read.values())))
    atomic_write_text(out / "table.md", (f"## {title}\n\n" if title else "") + markdown)
    plot(summary, out / "curves.png", title)
    return summary
