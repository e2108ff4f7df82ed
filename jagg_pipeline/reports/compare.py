"""The comparison report of one experiment's runs: an HTML page with PNG plots and a markdown table.

Runs come from the tracker (read back from MLflow, as
:func:`jagg_pipeline.reports.tracking.run_metrics`
rebuilds them) or, with tracking off, from their folders; either way they are compared by
:mod:`jagg_pipeline.reports.summary`'s functions. Plots: held-out metrics and rollout reward vs
round
with seed bands (``curves.png``); update-stage seconds per round and the speed-up over the
``exact`` variant (``speed.png``); per-window cos-sim with the exact gradient vs round, when
``jagg_frac: auto`` or ``jagg.probe_every`` probed it, else a note saying how
(``cos_sim.png``). Torch-free.
"""

from __future__ import annotations

import html
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jagg_pipeline.io.artifacts import atomic_write_text, make_folder
from jagg_pipeline.io.figures import pyplot, save_figure
from jagg_pipeline.reports.summary import (
    UPDATE_PARTS,
    RunMetrics,
    integer_ticks,
    plot,
    stage_seconds,
    stage_table,
    summarise,
    table,
)

PROBE = re.compile(r"^probe\.(\d+)\.(jagg|no_interp)\.cos_sim$")
REFERENCE = "exact"
NO_PROBES = (
    "No per-window cos-sim in these runs: set jagg.probe_every: K (or jagg_frac: auto) to "
    "probe every window against the exact gradient."
)


def update_seconds(runs: Sequence[RunMetrics]) -> dict[str, dict[int, float]]:
    """Per variant: update-stage seconds (forward + backward + optimizer) per round, seed mean."""
    per_variant: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        rounds: dict[int, float] = {}
        for line in run.stage("train"):
            seconds = sum(line.get(f"time.{part}") or 0.0 for part in UPDATE_PARTS)
            rounds[line["round"]] = rounds.get(line["round"], 0.0) + seconds
        for round_index, seconds in rounds.items():
            per_variant.setdefault(run.variant, {}).setdefault(round_index, []).append(seconds)
    return {
        variant: {r: statistics.fmean(v) for r, v in sorted(rounds.items())}
        for variant, rounds in per_variant.items()
    }


def exact_twins(runs: Sequence[RunMetrics]) -> dict[str, str | None]:
    """Per variant, the exact variant it is compared with (None: there is none).

    The one whose runs compute their gradients exactly and are otherwise set up alike (the
    same :attr:`RunMetrics.setting`), such as ``flux_exact`` for ``flux_jagg`` in a backbone
    x mode cross.
    """
    exact = {run.setting: run.variant for run in runs if run.mode == "exact" and run.setting}
    return {run.variant: exact.get(run.setting) if run.setting else None for run in runs}


def plot_speed(
    seconds: Mapping[str, Mapping[int, float]],
    path: Path,
    title: str = "",
    twins: Mapping[str, str | None] | None = None,
) -> Path:
    """Update seconds per round, and each variant's speed-up over its exact twin.

    The speed-up is of the mean over rounds; ``twins`` from :func:`exact_twins` (default: the
    variant named ``exact``).
    """
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    for variant, rounds in seconds.items():
        left.plot(list(rounds), list(rounds.values()), marker="o", markersize=3, label=variant)
    left.set(title="update stage per round", xlabel="round", ylabel="seconds")
    integer_ticks(left)
    left.grid(alpha=0.3)
    left.legend()
    means = {v: statistics.fmean(r.values()) for v, r in seconds.items() if r}
    if twins is None:
        twins = {v: REFERENCE if REFERENCE in means else None for v in means}
    paired = {v: twins.get(v) for v in means if twins.get(v) in means}
    if paired:
        names = list(paired)
        speedups = [means[paired[v]] / means[v] for v in names]
        bars = right.bar(names, speedups, color="tab:green")
        right.bar_label(bars, fmt="%.2fx")
        right.axhline(1.0, color="grey", linewidth=1)
        right.set(title="speed-up of the update stage vs its exact variant", ylabel="x")
        right.tick_params(axis="x", labelrotation=30 if len(names) > 4 else 0)
    else:
        right.text(0.5, 0.5, "no exact variant set up alike to compare with", ha="center")
        right.set_axis_off()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return save_figure(figure, path)


def approximation(run: RunMetrics) -> str:
    """The approximation whose probes a run is shown for: its own ``jagg.mode``.

    ``no_interp`` or ``jagg``; exact runs are shown for ``jagg``.
    """
    return "no_interp" if run.mode == "no_interp" else "jagg"


def cos_sims(runs: Sequence[RunMetrics]) -> dict[str, dict[tuple[int, int], float]]:
    """Per variant: probed cos-sim of its approximation with the exact gradient.

    Keys ``"<variant>: cos-sim of <approximation>"``, values by (window, round), mean over
    seeds.
    """
    found: dict[str, dict[tuple[int, int], list[float]]] = {}
    for run in runs:
        mode = approximation(run)
        label = f"{run.variant}: cos-sim of {mode}"
        for line in run.stage("train"):
            for key, value in line.items():
                match = PROBE.match(key)
                if match and match.group(2) == mode and value is not None:
                    cell = (int(match.group(1)), line["round"])
                    found.setdefault(label, {}).setdefault(cell, []).append(value)
    return {v: {c: statistics.fmean(x) for c, x in cells.items()} for v, cells in found.items()}


def plot_cos_sims(
    cells: Mapping[str, Mapping[tuple[int, int], float]], path: Path, title: str = ""
) -> Path:
    """One heatmap per variant: window (rows) x round (columns), colour = cos-sim.

    Without probes the figure says how to get them (the report always has this plot).
    """
    plt = pyplot()
    if not cells:
        figure, axis = plt.subplots(figsize=(8, 1.6), dpi=100)
        axis.text(0.5, 0.5, NO_PROBES, ha="center", va="center", wrap=True)
        axis.set_axis_off()
        return save_figure(figure, path)
    figure, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 3.6), dpi=100)
    axes = axes if len(cells) > 1 else [axes]
    for axis, (variant, values) in zip(axes, cells.items(), strict=True):
        windows = sorted({w for w, _ in values})
        rounds = sorted({r for _, r in values})
        grid = [[values.get((w, r), float("nan")) for r in rounds] for w in windows]
        image = axis.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        axis.set_xticks(range(len(rounds)), rounds)
        axis.set_yticks(range(len(windows)), windows)
        axis.set(title=f"{variant} with exact", xlabel="round", ylabel="window (0: high noise)")
        for (row, column), value in np.ndenumerate(np.asarray(grid)):
            colour = "black" if value > 0.5 else "white"  # readable on viridis
            axis.text(column, row, f"{value:.2f}", ha="center", va="center", color=colour)
        figure.colorbar(image, ax=axis)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return save_figure(figure, path)


def _html(
    title: str, source: str, markdown: str, images: Mapping[str, str], several: bool = True
) -> str:
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    head, body = (cells[0], cells[2:]) if cells else ([], [])
    table_html = "<table>\n<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>\n"
    for row in body:
        table_html += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n"
    table_html += "</table>"
    spread = (
        "Mean +- std over seeds."
        if several
        else "One seed per variant (n=1): values alone, no spread."
    )
    figures = "\n".join(
        f'<figure><img src="{name}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for name, caption in images.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>Runs read from {html.escape(source)}. {spread}</p>
{table_html}
{figures}
</body></html>
"""


def write_comparison(
    runs: Sequence[RunMetrics], out: str | Path, title: str, source: str
) -> dict[str, Any]:
    """``index.html``, ``table.md`` and the PNGs of ``runs`` in the folder ``out``."""
    out = make_folder(out)
    summary = summarise(runs)
    markdown = table(summary)
    # As the summary's table.md: the variants, then the stages' start-up.
    stages = stage_table(stage_seconds(runs))
    atomic_write_text(out / "table.md", f"## {title}\n\n{markdown}{stages}")
    several = any(len(s["seeds"]) > 1 for s in summary.values())
    bands = "seed bands" if several else "one seed, n=1"
    images = {"curves.png": f"held-out metrics and rollout reward vs round ({bands})"}
    plot(summary, out / "curves.png", title)
    plot_speed(update_seconds(runs), out / "speed.png", title, exact_twins(runs))
    images["speed.png"] = (
        "update-stage seconds per round and speed-up vs the exact variant set up alike"
    )
    plot_cos_sims(cos_sims(runs), out / "cos_sim.png", title)
    images["cos_sim.png"] = (
        "per-window cos-sim of each variant's approximation with the exact gradient vs round"
    )
    atomic_write_text(out / "index.html", _html(title, source, markdown, images, several))
    return summary
