"""The comparison report of one experiment's runs: an HTML page with PNG plots and a markdown table.

Runs come from the tracker (read back from MLflow, as
:func:`jagg_pipeline.reports.tracking.run_metrics` rebuilds them) or, with tracking off, from
their folders; either way they are compared by :mod:`jagg_pipeline.reports.summary`'s
functions. Plots: held-out metrics and rollout reward vs round with seed bands
(``curves.png``); update-stage seconds per round and the speed-up over the exact variant set
up alike, with its spread over rounds and seeds and a note where that spread takes in 1.0x
(``speed.png``, the notes on the page too); per-window cos-sim with the exact gradient vs
round, when ``jagg_frac: auto`` or ``jagg.probe_every`` probed it, else a note saying how
(``cos_sim.png``). Panels wrap at 3 to a row; a figure without data says why instead of
drawing empty axes. Torch-free.
"""

from __future__ import annotations

import html
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jagg_pipeline.io.artifacts import atomic_write_text, make_folder
from jagg_pipeline.io.figures import (
    footnote,
    note_figure,
    panel_grid,
    round_ticks,
    save_figure,
    variant_colours,
)
from jagg_pipeline.io.tables import html_table, markdown_table
from jagg_pipeline.reports.summary import (
    UPDATE_PARTS,
    RunMetrics,
    plot,
    stage_seconds,
    stage_table,
    summarise,
    table_cells,
)

PROBE = re.compile(r"^probe\.(\d+)\.(jagg|no_interp)\.cos_sim$")
REFERENCE = "exact"
NO_PROBES = (
    "No per-window cos-sim in these runs: set jagg.probe_every: K (or jagg_frac: auto) to "
    "probe every window against the exact gradient."
)
NO_TIMINGS = "No update-stage timings in these runs: they trained no rounds."
NO_TWINS = "No exact variant set up alike to compare the update stage's speed with."
# Heatmap cells are labelled with their values, and every round ticked, up to this many
# rounds; past it the labels overlap and the colour bar says the values.
LABELLED_ROUNDS = 12


def update_seconds(runs: Sequence[RunMetrics]) -> dict[str, dict[int, list[float]]]:
    """Per variant, per round: each seed's update-stage seconds (forward + backward + optimizer).

    Rounds in order; a round's list has one value per seed that trained it, in run order.
    """
    per_variant: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        rounds: dict[int, float] = {}
        for line in run.stage("train"):
            seconds = sum(line.get(f"time.{part}") or 0.0 for part in UPDATE_PARTS)
            rounds[line["round"]] = rounds.get(line["round"], 0.0) + seconds
        for round_index, seconds in rounds.items():
            per_variant.setdefault(run.variant, {}).setdefault(round_index, []).append(seconds)
    return {variant: dict(sorted(rounds.items())) for variant, rounds in per_variant.items()}


@dataclass(frozen=True)
class Speedup:
    """A variant's update-stage speed-up over its exact twin, as measured round by round.

    ``ratios``: the twin's seconds over the variant's in the same round, every seed of one
    with every seed of the other (seeds of one setting are repeats of one measurement).
    """

    twin: str
    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median ratio: the speed-up shown."""
        return float(np.median(self.ratios))

    @property
    def quartiles(self) -> tuple[float, float]:
        """The first and third quartile of the ratios: the middle half of the measurements."""
        q1, q3 = np.percentile(self.ratios, [25, 75])
        return float(q1), float(q3)

    @property
    def within_spread(self) -> bool:
        """Whether the middle half of the ratios takes in 1.0x: a speed-up the noise can make."""
        q1, q3 = self.quartiles
        return q1 <= 1.0 <= q3


def speedups(
    seconds: Mapping[str, Mapping[int, Sequence[float]]],
    twins: Mapping[str, str | None] | None = None,
) -> dict[str, Speedup]:
    """Per variant with a twin in ``seconds``: its :class:`Speedup` over the twin.

    ``seconds`` from :func:`update_seconds`, ``twins`` from :func:`exact_twins` (default: the
    variant named ``exact``). Ratios pair rounds, never one round with another: a round's
    seconds depend on the round (the first one's include warming up), not only on the
    gradient engine. A variant that shares no round with its twin has none.
    """
    if twins is None:
        twins = dict.fromkeys(seconds, REFERENCE)
    found: dict[str, Speedup] = {}
    for variant, rounds in seconds.items():
        twin = twins.get(variant)
        if twin is None or twin == variant or twin not in seconds:
            continue
        ratios = tuple(
            reference / own
            for round_index, own_seconds in rounds.items()
            for reference in seconds[twin].get(round_index, [])
            for own in own_seconds
            # A round whose lines carry no timings sums to 0 s: it has no ratio.
            if own > 0 and reference > 0
        )
        if ratios:
            found[variant] = Speedup(twin, ratios)
    return found


def speed_notes(
    seconds: Mapping[str, Mapping[int, Sequence[float]]], found: Mapping[str, Speedup]
) -> list[str]:
    """What ``speed.png`` cannot show by itself, one sentence each (none: nothing to say).

    No timings or no twin to compare with; a speed-up measured once (no spread to judge it
    by); a speed-up whose middle half of measurements takes in 1.0x (its spread is wider
    than its effect).
    """
    if not any(seconds.values()):
        return [NO_TIMINGS]
    if not found:
        return [NO_TWINS]
    notes = []
    for variant, speedup in found.items():
        if len(speedup.ratios) < 2:
            notes.append(
                f"{variant}: {speedup.median:.2f}x over {speedup.twin} is one measurement "
                "(one round, one seed): no spread to judge it by."
            )
        elif speedup.within_spread:
            q1, q3 = speedup.quartiles
            notes.append(
                f"{variant}: {speedup.median:.2f}x over {speedup.twin} is within the noise: "
                f"the middle half of its {len(speedup.ratios)} per-round ratios spans "
                f"{q1:.2f}x to {q3:.2f}x, taking in 1.0x (the spread is wider than the effect)."
            )
    return notes


def exact_twins(runs: Sequence[RunMetrics]) -> dict[str, str | None]:
    """Per variant, the exact variant it is compared with (None: there is none).

    The one whose runs compute their gradients exactly and are otherwise set up alike (the
    same :attr:`RunMetrics.setting`), such as ``flux_exact`` for ``flux_jagg`` in a backbone
    x mode cross.
    """
    exact = {run.setting: run.variant for run in runs if run.mode == "exact" and run.setting}
    return {run.variant: exact.get(run.setting) if run.setting else None for run in runs}


def plot_speed(
    seconds: Mapping[str, Mapping[int, Sequence[float]]],
    found: Mapping[str, Speedup],
    path: Path,
    title: str = "",
) -> Path:
    """Update seconds per round (seed mean, min-max band), and each variant's speed-up.

    ``seconds`` from :func:`update_seconds`, ``found`` from :func:`speedups`. The speed-up is
    the median of its per-round ratios, drawn with a thick bar over their quartiles and
    whiskers to their minimum and maximum; the notes of :func:`speed_notes` are written under
    the panels. No timings: a figure of its note. No twins: the seconds panel alone.
    """
    notes = speed_notes(seconds, found)
    timed = {variant: rounds for variant, rounds in seconds.items() if rounds}
    if not timed:
        return save_figure(note_figure(notes), path)
    figure, axes = panel_grid(2 if found else 1, size=(5.5, 3.6))
    colours = variant_colours(seconds)
    left = axes[0]
    for variant, rounds in timed.items():
        xs = list(rounds)
        left.plot(
            xs,
            [statistics.fmean(v) for v in rounds.values()],
            marker="o",
            markersize=3,
            color=colours[variant],
            label=variant,
        )
        if any(len(v) > 1 for v in rounds.values()):
            low, high = [min(v) for v in rounds.values()], [max(v) for v in rounds.values()]
            left.fill_between(xs, low, high, color=colours[variant], alpha=0.15)
    banded = any(len(v) > 1 for rounds in timed.values() for v in rounds.values())
    band = " (band: min-max over seeds)" if banded else ""
    left.set(title=f"update stage per round{band}", xlabel="round", ylabel="seconds")
    round_ticks(left, [r for rounds in timed.values() for r in rounds])
    left.grid(alpha=0.3)
    left.legend(fontsize=8 if len(timed) > 3 else None)
    if found:
        _draw_speedups(axes[1], found, colours)
    if title:
        figure.suptitle(title)
    figure.tight_layout(rect=(0, footnote(figure, notes), 1, 1))
    return save_figure(figure, path)


def _draw_speedups(axis: Any, found: Mapping[str, Speedup], colours: Mapping[str, str]) -> None:
    """Each variant's median speed-up, its quartiles (thick) and its min-max (whiskers)."""
    for index, (variant, speedup) in enumerate(found.items()):
        median, (q1, q3) = speedup.median, speedup.quartiles
        low, high = min(speedup.ratios), max(speedup.ratios)
        colour = colours[variant]
        axis.errorbar(
            index,
            median,
            yerr=[[median - low], [high - median]],
            fmt="none",
            ecolor=colour,
            elinewidth=1,
            capsize=4,
        )
        axis.errorbar(
            index,
            median,
            yerr=[[median - q1], [q3 - median]],
            fmt="o",
            color=colour,
            elinewidth=6,
            markersize=5,
            markeredgecolor="black",
        )
        mark = "\n(noise)" if speedup.within_spread else ""
        axis.annotate(
            f"{median:.2f}x{mark}",
            (index, high),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axis.axhline(1.0, color="grey", linewidth=1)
    axis.set_xticks(range(len(found)), list(found))
    axis.set_xlim(-0.5, len(found) - 0.5)
    axis.margins(y=0.2)  # room above the whiskers for the labels
    axis.tick_params(axis="x", labelrotation=30 if len(found) > 3 else 0)
    axis.set(title="update-stage speed-up vs its exact variant", ylabel="x (exact s / own s)")
    axis.grid(alpha=0.3, axis="y")


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

    At most 3 heatmaps to a row. Cells are labelled with their values up to
    :data:`LABELLED_ROUNDS` rounds; past it, one round in every few is ticked. Without probes
    the figure says how to get them (the report always has this plot).
    """
    if not cells:
        return save_figure(note_figure([NO_PROBES]), path)
    figure, axes = panel_grid(len(cells), size=(5, 3.6))
    for axis, (variant, values) in zip(axes, cells.items(), strict=True):
        windows = sorted({w for w, _ in values})
        rounds = sorted({r for _, r in values})
        grid = np.asarray([[values.get((w, r), np.nan) for r in rounds] for w in windows])
        image = axis.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        step = -(-len(rounds) // LABELLED_ROUNDS)
        axis.set_xticks(range(0, len(rounds), step), rounds[::step])
        axis.set_yticks(range(len(windows)), windows)
        axis.set(title=f"{variant} with exact", xlabel="round", ylabel="window (0: high noise)")
        if step == 1:
            for (row, column), value in np.ndenumerate(grid):
                if np.isnan(value):
                    continue  # a round that did not probe this window: left blank
                colour = "black" if value > 0.5 else "white"  # readable on viridis
                axis.text(column, row, f"{value:.2f}", ha="center", va="center", color=colour)
        figure.colorbar(image, ax=axis)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return save_figure(figure, path)


def _html(
    title: str,
    source: str,
    cells: tuple[Sequence[str], Sequence[Sequence[str]]],
    images: Mapping[str, str],
    several: bool = True,
    notes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The page: the table of ``cells`` (head, rows), then each image, its caption, ``notes``."""
    table_html = html_table(*cells)
    spread = (
        "Mean +- std over seeds."
        if several
        else "One seed per variant (n=1): values alone, no spread."
    )
    notes = notes or {}
    figures = "\n".join(
        f'<figure><img src="{name}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}"
        + "".join(f'<p class="note">{html.escape(note)}</p>' for note in notes.get(name, []))
        + "</figcaption></figure>"
        for name, caption in images.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}img{{max-width:100%}}
.note{{color:#a40;margin:0.3em 0}}</style></head>
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
    cells = table_cells(summary)
    # As the summary's table.md: the variants, then the stages' start-up.
    stages = stage_table(stage_seconds(runs))
    atomic_write_text(out / "table.md", f"## {title}\n\n{markdown_table(*cells)}{stages}")
    several = any(len(s["seeds"]) > 1 for s in summary.values())
    bands = "seed bands" if several else "one seed, n=1"
    images = {"curves.png": f"held-out metrics and rollout reward vs round ({bands})"}
    plot(summary, out / "curves.png", title)
    seconds = update_seconds(runs)
    found = speedups(seconds, exact_twins(runs))
    plot_speed(seconds, found, out / "speed.png", title)
    images["speed.png"] = (
        "update-stage seconds per round and speed-up vs the exact variant set up alike "
        "(median over rounds and seeds; thick: quartiles, whiskers: min-max)"
    )
    plot_cos_sims(cos_sims(runs), out / "cos_sim.png", title)
    images["cos_sim.png"] = (
        "per-window cos-sim of each variant's approximation with the exact gradient vs round"
    )
    notes = {"speed.png": speed_notes(seconds, found)}
    atomic_write_text(out / "index.html", _html(title, source, cells, images, several, notes))
    return summary
