"""The gradient diagnostic's report read back: the printed tables and the worst window.

Pure functions of the dict :func:`jagg_pipeline.bench.gradcheck.run_gradcheck` returns (torch-free):
the ``gradcheck`` command prints :func:`format_report` and gates on :func:`worst_rel_err`.
"""

from __future__ import annotations

from typing import Any

from jagg_pipeline.io.tables import format_number


def worst_rel_err(report: dict[str, Any]) -> float:
    """The largest per-window jagg rel_err of either layout."""
    layouts = [report, report["shared"]]
    return max(w["jagg"]["rel_err"] for layout in layouts for w in layout["windows"])


def _layout_lines(layout: dict[str, Any]) -> list[str]:
    lines = [
        f"{'window':>6} {'interval':>10} {'sigma_start':>11} {'sigma_end':>9} "
        f"{'jagg cos':>10} {'jagg rel_err':>12} {'no_int cos':>10} {'no_int rel_err':>14}",
    ]
    for w in layout["windows"]:
        span = f"{w['interval'][0]}-{w['interval'][-1]}"
        lines.append(
            f"{w['index']:>6} {span:>10} {w['sigma_start']:>11.4f} {w['sigma_end']:>9.4f} "
            f"{format_number(w['jagg']['cos_sim'], '>10.6f')} {w['jagg']['rel_err']:>12.3e} "
            f"{format_number(w['no_interp']['cos_sim'], '>10.6f')} "
            f"{w['no_interp']['rel_err']:>14.3e}"
        )
    t = layout["trajectory"]
    calls = layout["backward_calls"]
    return [
        *lines,
        f"whole trajectory at jagg_frac={t['jagg_frac']}: "
        f"jagg cos={format_number(t['jagg']['cos_sim'], '.6f')} "
        f"rel_err={t['jagg']['rel_err']:.3e}; "
        f"no_interp cos={format_number(t['no_interp']['cos_sim'], '.6f')} "
        f"rel_err={t['no_interp']['rel_err']:.3e}",
        f"network backward calls: exact={calls['exact']} jagg={calls['jagg']} "
        f"no_interp={calls['no_interp']}",
    ]


def format_report(report: dict[str, Any]) -> str:
    """Fixed-width tables of the per-window agreement and backward calls, per anchor layout."""
    s = report["settings"]
    return "\n".join(
        [
            f"gradcheck: backbone={s['backbone']} trajectory={s['trajectory']} "
            f"dtype={s['dtype']} window={s['window']} steps={s['num_steps']} "
            f"batch={s['batch']} weights={s['weights']} no_interp={s['no_interp']} "
            f"endpoint_backward={s['endpoint_backward']}",
            "",
            "separate anchors (each window interpolates between its own two ends):",
            *_layout_lines(report),
            "",
            "shared anchors (adjacent windows share their boundary step; the same span):",
            *_layout_lines(report["shared"]),
        ]
    )
