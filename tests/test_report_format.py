"""How tables and plots report seeds and rounds (summary, compare).

One seed has no spread: its table cells show the value alone (no ``+- 0.000``) and its curves
no band; several seeds keep mean +- std. Round axes are ticked at whole numbers.
"""

from __future__ import annotations

from matplotlib.collections import PolyCollection

from jagg_pipeline.reports import summary
from jagg_pipeline.reports.compare import plot_speed, speedups, update_seconds, write_comparison
from jagg_pipeline.reports.summary import RunMetrics, plot, summarise, table


def _run(variant: str, seed: int, rise: float) -> RunMetrics:
    """Two rounds: evaluated after 0 and 1 rounds, scored and trained in rounds 0 and 1."""
    lines = []
    for round_index in (0, 1):
        lines.append({"stage": "score", "round": round_index, "total_mean": 0.2 + round_index})
        lines.append(
            {"stage": "train", "round": round_index, "time.forward": 1.0 + seed}
            | {"time.backward": 2.0, "time.optimizer": 0.5}
        )
    evaluations = {0: {"toy": 0.1}, 1: {"toy": 0.1 + rise}}
    return RunMetrics(variant, seed, lines=lines, evaluations=evaluations)


def _assert_integer_ticks(axis) -> None:
    ticks = axis.get_xticks()
    assert len(ticks) >= 2, ticks
    assert all(float(t).is_integer() for t in ticks), (axis.get_xlabel(), list(ticks))


def test_one_seed_shows_the_value_alone_and_several_seeds_mean_pm_std():
    mean_pm_std = summary.mean_pm_std
    assert mean_pm_std(0.5, 0.0, 1) == "0.500"
    assert mean_pm_std(0.4, 0.0, 1, "+.3f") == "+0.400"
    assert mean_pm_std(0.5, 0.1, 3) == "0.500 +- 0.100"
    assert mean_pm_std(0.4, 0.05, 2, "+.3f") == "+0.400 +- 0.050"


def test_a_one_seed_table_has_no_pm():
    text = table(summarise([_run("exact", 0, 0.4), _run("jagg", 0, 0.3)]))
    assert "+-" not in text, text
    assert "| exact | 1 | 0.100 -> 0.500 (+0.400) |" in text, text
    assert "| jagg | 1 | 0.100 -> 0.400 (+0.300) |" in text, text


def test_several_seeds_keep_mean_pm_std_and_a_mixed_table_shows_each_as_it_is():
    runs = [_run("exact", 0, 0.4), _run("exact", 1, 0.2), _run("jagg", 0, 0.3)]
    text = table(summarise(runs))
    assert "| exact | 2 | 0.100 -> 0.400 +- 0.141 (+0.300 +- 0.141) |" in text, text
    assert "| jagg | 1 | 0.100 -> 0.400 (+0.300) |" in text, text


def test_curves_tick_rounds_at_whole_numbers(tmp_path, saved_figures):
    plot(summarise([_run("exact", 0, 0.4), _run("exact", 1, 0.2)]), tmp_path / "curves.png")
    (figure,) = saved_figures
    axes = figure.get_axes()
    assert [axis.get_xlabel() for axis in axes] == ["rounds trained", "round"]
    for axis in axes:
        _assert_integer_ticks(axis)
    # Several seeds: bands and the mean +- std legend.
    assert any(isinstance(c, PolyCollection) for c in axes[0].collections)
    assert axes[0].get_legend().get_title().get_text() == "mean +- std over seeds"


def test_one_seed_curves_have_no_band_and_say_n_1(tmp_path, saved_figures):
    plot(summarise([_run("exact", 0, 0.4), _run("jagg", 0, 0.3)]), tmp_path / "curves.png")
    (figure,) = saved_figures
    for axis in figure.get_axes():
        assert not any(isinstance(c, PolyCollection) for c in axis.collections)
    legend = figure.get_axes()[0].get_legend()
    assert "n=1" in legend.get_title().get_text()
    assert "+-" not in legend.get_title().get_text()


def test_curves_of_a_run_without_evaluations_still_draw(tmp_path, saved_figures):
    """A single panel (only the rollout reward): one axes, not an array of them."""
    run = _run("exact", 0, 0.4)
    run.evaluations = {}
    plot(summarise([run]), tmp_path / "curves.png")
    (figure,) = saved_figures
    (axis,) = figure.get_axes()
    _assert_integer_ticks(axis)


def test_update_seconds_tick_rounds_at_whole_numbers(tmp_path, saved_figures):
    runs = [_run("exact", 0, 0.4), _run("jagg", 0, 0.3)]
    seconds = update_seconds(runs)
    plot_speed(seconds, speedups(seconds), tmp_path / "speed.png")
    (figure,) = saved_figures
    left = figure.get_axes()[0]
    assert left.get_xlabel() == "round"
    _assert_integer_ticks(left)


def test_the_comparison_page_of_one_seed_says_n_1(tmp_path):
    write_comparison([_run("exact", 0, 0.4), _run("jagg", 0, 0.3)], tmp_path, "t", "files")
    page = (tmp_path / "index.html").read_text()
    assert "n=1" in page and "+-" not in page, page
    assert "+-" not in (tmp_path / "table.md").read_text()
    write_comparison([_run("exact", 0, 0.4), _run("exact", 1, 0.2)], tmp_path, "t", "files")
    assert "Mean +- std over seeds." in (tmp_path / "index.html").read_text()
