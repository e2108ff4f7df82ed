"""The summary and comparison pages read right at any count of variants, rounds and evaluations.

Built from synthetic runs (:class:`~jagg_pipeline.reports.summary.RunMetrics`, as the files
and MLflow give them) for one variant of one round, six variants of several rounds and an
evaluation-only experiment: round axes have whole-number ticks over a sane range, no axes is
drawn without data, six heatmaps wrap into a grid of at most 3 columns, the speed panel
draws its spread (error bars) and notes, on the figure and the page, a speed-up within its
spread and no other, no table prints ``-0.000``, and the page's images load in headless
Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from jagg_pipeline.io.tables import format_number
from jagg_pipeline.reports.compare import (
    speed_notes,
    speedups,
    update_seconds,
    write_comparison,
)
from jagg_pipeline.reports.summary import RunMetrics, plot, summarise, table

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IMAGES = ("curves.png", "speed.png", "cos_sim.png")
# Per variant of the six: its mode and its update-stage seconds in each round (the exact
# variant's are 10 s): clear speed-ups, a slow-down, and "noisy", whose speed-up over
# exact swings across 1.0x from round to round.
SIX = {
    "exact": ("exact", (10.0, 10.2, 9.8, 10.1)),
    "jagg": ("jagg", (5.0, 5.1, 4.9, 5.0)),
    "jagg_half": ("jagg", (7.0, 7.2, 6.9, 7.1)),
    "no_interp": ("no_interp", (4.0, 4.1, 3.9, 4.0)),
    "noisy": ("jagg", (6.0, 14.0, 7.0, 13.0)),
    "slow": ("jagg", (12.0, 12.5, 12.2, 12.1)),
}


def _run(variant: str, seed: int, mode: str, seconds: tuple[float, ...]) -> RunMetrics:
    """A run of ``len(seconds)`` rounds, evaluated before and after each, probed each round."""
    lines = []
    for round_index, update in enumerate(seconds):
        lines.append(
            {"stage": "score", "round": round_index, "total_mean": 0.3 + 0.1 * round_index}
            | {"time.import": 2.0, "time.load": 1.0, "time.work": 3.0}
        )
        # Exact runs are probed for jagg (compare.approximation).
        probed = "no_interp" if mode == "no_interp" else "jagg"
        probes = {f"probe.{w}.{probed}.cos_sim": 0.9 - 0.2 * w for w in (0, 1)}
        lines.append(
            {"stage": "train", "round": round_index, "time.forward": update / 2}
            | {"time.backward": update / 2 - 0.5, "time.optimizer": 0.5 + 0.01 * seed}
            | probes
        )
    # A metric that barely moves, and seeds that differ by a hair: a mean or a rise of -0.0001.
    evaluations = {
        trained: {"toy": 0.2 + 0.05 * trained, "flat": -0.0001 * (seed + 1) * (trained > 0)}
        for trained in range(len(seconds) + 1)
    }
    return RunMetrics(variant, seed, lines, evaluations, mode=mode, setting="alike")


def six_variants() -> list[RunMetrics]:
    """Six variants of four rounds, two seeds each (the second a little slower)."""
    return [
        _run(variant, seed, mode, tuple(s * (1 + 0.02 * seed) for s in seconds))
        for variant, (mode, seconds) in SIX.items()
        for seed in (0, 1)
    ]


def _compare(runs: list[RunMetrics], out: Path, figures: list[Figure]) -> dict[str, Figure]:
    """``write_comparison`` of ``runs`` into ``out``; its figures by image name."""
    write_comparison(runs, out, "test", "synthetic runs")
    # write_comparison draws the images in the page's order.
    return dict(zip(IMAGES, figures, strict=True))


def _visible_ticks(axis) -> list[float]:
    low, high = sorted(axis.get_xlim())
    return [float(t) for t in axis.get_xticks() if low <= t <= high]


def _assert_round_axes(figure: Figure, last: int) -> None:
    """Every round axis: whole-number ticks, at least one, over rounds 0 to ``last`` at most.

    And at least a round wide: matplotlib's own range around one round is -0.05 to 0.05.
    """
    for axis in figure.get_axes():
        if "round" not in axis.get_xlabel():
            continue
        ticks = _visible_ticks(axis)
        assert ticks and all(t.is_integer() for t in ticks), (axis.get_title(), ticks)
        low, high = axis.get_xlim()
        assert low > -1 and high < last + 1 and high - low >= 1, (axis.get_title(), low, high)


def _assert_no_empty_axes(figure: Figure) -> None:
    """Every axes draws something (colour bars and drawn text notes count)."""
    for axis in figure.get_axes():
        drawn = axis.lines or axis.collections or axis.images or axis.patches
        assert drawn or axis.get_label() == "<colorbar>", axis.get_title()


def _figure_text(figure: Figure) -> str:
    return "\n".join(text.get_text() for text in figure.texts)


def _assert_no_negative_zero(folder: Path) -> None:
    for name in ("table.md", "index.html"):
        text = (folder / name).read_text()
        assert "-0.000" not in text, (name, text)


def _assert_images_load(page: Path) -> None:
    """Open ``page`` in headless Chromium: every image decodes (naturalWidth > 0)."""
    if CHROMIUM is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true and no chromium (apt install chromium)")
        pytest.skip("no chromium to open the report")
    # The page itself beside its images, with a script that reports each one's decoded
    # width: its own <img> tags are measured, their src as written.
    probe = page.with_name("probe.html")
    probe.write_text(
        page.read_text().replace(
            "</body>",
            "<pre id=w></pre><script>window.onload = () => {document.getElementById('w')"
            ".textContent = JSON.stringify([...document.images].map("
            "i => [i.getAttribute('src'), i.naturalWidth]))}</script></body>",
        )
    )
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu"]
    command += ["--allow-file-access-from-files", "--virtual-time-budget=5000", "--dump-dom"]
    dom = subprocess.run(
        [*command, probe.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    widths = dict(json.loads(dom.split('<pre id="w">')[1].split("</pre>")[0]))
    assert set(widths) == set(IMAGES) and all(w > 0 for w in widths.values()), widths


def test_format_number_never_prints_a_negative_zero():
    assert format_number(-0.0001) == "0.000"
    assert format_number(-0.0) == "0.000"
    assert format_number(-0.0004, "+.3f") == "+0.000"
    assert format_number(-0.0004, ">8.3f") == "   0.000"
    assert format_number(-0.0006) == "-0.001"
    assert format_number(-0.001, ".0%") == "0%"
    assert format_number(3, "d") == "3"


def test_one_variant_of_one_round(tmp_path, saved_figures):
    run = _run("exact", 0, "exact", (10.0,))
    figures = _compare([run], tmp_path, saved_figures)
    for figure in figures.values():
        _assert_round_axes(figure, last=1)  # evaluated after 0 and 1 rounds; round 0 trained
        _assert_no_empty_axes(figure)
    rollout = next(a for a in figures["curves.png"].get_axes() if a.get_title() == "rollout reward")
    assert _visible_ticks(rollout) == [0.0], _visible_ticks(rollout)
    # No other variant to compare speed with: the seconds panel alone, and a note saying so.
    (seconds,) = figures["speed.png"].get_axes()
    assert _visible_ticks(seconds) == [0.0]
    assert "No exact variant set up alike" in _figure_text(figures["speed.png"])
    assert len(figures["cos_sim.png"].get_axes()) == 2  # one heatmap and its colour bar
    _assert_no_negative_zero(tmp_path)
    assert "No exact variant set up alike" in (tmp_path / "index.html").read_text()
    _assert_images_load(tmp_path / "index.html")


def test_six_variants_of_several_rounds(tmp_path, saved_figures):
    figures = _compare(six_variants(), tmp_path, saved_figures)
    for figure in figures.values():
        _assert_round_axes(figure, last=4)
        _assert_no_empty_axes(figure)
    # Six heatmaps (and their colour bars) in two rows of three.
    heatmaps = [a for a in figures["cos_sim.png"].get_axes() if a.images]
    assert len(heatmaps) == 6
    # A colour bar splits its heatmap's cell: the cell is the topmost subplot spec.
    cells = [a.get_subplotspec().get_topmost_subplotspec() for a in heatmaps]
    columns = {cell.colspan.start for cell in cells}
    rows = {cell.rowspan.start for cell in cells}
    assert len(columns) <= 3 and len(rows) == 2, (columns, rows)
    # The speed-up panel: one median with quartile and min-max error bars per variant.
    speed = figures["speed.png"].get_axes()[1]
    bars = [c for c in speed.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 * 5, bars
    assert [t.get_text() for t in speed.get_xticklabels()] == [v for v in SIX if v != "exact"]
    notes = _figure_text(figures["speed.png"])
    assert "noisy:" in notes and "within the noise" in notes, notes
    for clear in ("jagg:", "jagg_half:", "no_interp:", "slow:"):
        assert clear not in notes, notes
    page = (tmp_path / "index.html").read_text()
    assert "noisy: " in page and "jagg: " not in page, page
    _assert_no_negative_zero(tmp_path)
    _assert_images_load(tmp_path / "index.html")


def test_an_evaluation_only_experiment_draws_no_empty_panels(tmp_path, saved_figures):
    """No rollouts, no training: held-out panels only, and notes where the rest would be."""
    runs = [
        RunMetrics(variant, 0, evaluations={0: {"toy": 0.4, "flat": -0.0001}})
        for variant in ("base", "other")
    ]
    figures = _compare(runs, tmp_path, saved_figures)
    curves = figures["curves.png"].get_axes()
    assert [a.get_title() for a in curves] == ["held-out flat", "held-out toy"]
    for figure in figures.values():
        _assert_round_axes(figure, last=0)
        _assert_no_empty_axes(figure)
    assert figures["speed.png"].get_axes() == []
    assert "No update-stage timings" in _figure_text(figures["speed.png"])
    assert figures["cos_sim.png"].get_axes() == []
    assert "0.000" in (tmp_path / "table.md").read_text()
    _assert_no_negative_zero(tmp_path)


def test_nothing_to_plot_is_a_note_not_empty_axes(tmp_path, saved_figures):
    plot(summarise([RunMetrics("bare", 0)]), tmp_path / "curves.png")
    (figure,) = saved_figures
    assert figure.get_axes() == [] and "nothing to plot" in _figure_text(figure)


def test_the_spread_note_follows_the_ratios():
    """Within the spread: the middle half of the ratios takes in 1.0x; once: no spread."""
    seconds = update_seconds(six_variants())
    found = speedups(seconds, {v: "exact" for v in SIX})
    assert set(found) == set(SIX) - {"exact"}
    assert found["jagg"].median == pytest.approx(2.0, rel=0.05)
    assert not found["jagg"].within_spread and not found["slow"].within_spread
    assert found["noisy"].within_spread
    one = update_seconds([_run("exact", 0, "exact", (10.0,)), _run("jagg", 0, "jagg", (5.0,))])
    (note,) = speed_notes(one, speedups(one))
    assert note.startswith("jagg: 2.00x over exact is one measurement"), note


def test_tables_of_tiny_negatives_print_zero():
    text = table(summarise(six_variants()))
    assert "-0.000" not in text and "0.000" in text, text
