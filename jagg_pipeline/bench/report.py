"""The speed benchmark's outputs: its report dict as files, a figure and a printed table.

Reads what :func:`jagg_pipeline.bench.measure.run_bench` returns and computes nothing that
the dict lacks: ``bench.json`` (the dict as it is), ``bench.csv`` (one row per case, medians
and counts), ``speedup.png`` (speed-up vs W per jagg_frac on the sweep backbone) and the
fixed-width table the ``bench`` command prints.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from jagg_pipeline.bench.measure import COUNTS, SECONDS


def write_outputs(report: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``bench.json``, ``bench.csv`` and ``speedup.png`` in the folder ``out``."""
    from jagg_pipeline.io.artifacts import atomic_output, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "csv": out / "bench.csv", "png": out / "speedup.png"}
    atomic_write_text(paths["json"], json.dumps(report, indent=1) + "\n")
    columns = [
        "backbone",
        "case",
        "mode",
        "window",
        "frac",
        "reuse",
        "backward",
        *(f"{k}_median" for k in SECONDS),
        "speedup_median",
        "speedup_q1",
        "speedup_q3",
        "predicted_speedup",
        "analytic_rows",
        *COUNTS,
        "peak_activation_bytes",
        "memory_vs_exact",
    ]
    with atomic_output(paths["csv"]) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        for backbone in report["backbones"]:
            for row in backbone["cases"]:
                flat = {k: row[k] for k in columns if k in row}
                flat |= {f"{k}_median": row["seconds"][k]["median"] for k in SECONDS}
                flat |= {f"speedup_{k}": row["speedup"][k] for k in ("median", "q1", "q3")}
                writer.writerow(flat)
    plot_speedups(report, paths["png"])
    return paths


def plot_speedups(report: dict[str, Any], path: Path) -> Path:
    """Speed-up of the update stage vs W, one panel per jagg_frac, measured and analytic."""
    from jagg_pipeline.io.figures import pyplot, save_figure

    sweep = next(
        (b for b in report["backbones"] if b["backbone"] == report["settings"]["sweep_backbone"]),
        report["backbones"][0],
    )
    rows = [r for r in sweep["cases"] if r["mode"] != "exact" and r["backward"] == "joint"]
    fracs = sorted({r["frac"] for r in rows})
    figure, axes = pyplot().subplots(1, len(fracs), figsize=(4 * len(fracs), 3.6), sharey=True)
    axes = axes if len(fracs) > 1 else [axes]
    styles = {
        ("jagg", False): ("tab:blue", "jagg"),
        ("jagg", True): ("tab:green", "jagg + reuse"),
        ("no_interp", False): ("tab:orange", "no_interp"),
    }
    for axis, frac in zip(axes, fracs, strict=True):
        for (mode, reuse), (colour, label) in styles.items():
            line = sorted(
                (r for r in rows if (r["mode"], r["reuse"], r["frac"]) == (mode, reuse, frac)),
                key=lambda r: r["window"],
            )
            if not line:
                continue
            windows = [r["window"] for r in line]
            median = [r["speedup"]["median"] for r in line]
            low = [r["speedup"]["q1"] for r in line]
            high = [r["speedup"]["q3"] for r in line]
            axis.plot(windows, median, marker="o", color=colour, label=label)
            axis.fill_between(windows, low, high, color=colour, alpha=0.2)
            predicted = [r["predicted_speedup"] for r in line]
            axis.plot(windows, predicted, linestyle="--", color=colour, alpha=0.7)
        axis.axhline(1.0, color="grey", linewidth=1)
        axis.set(title=f"jagg_frac = {frac:g}", xlabel="window W", xticks=sorted(set(windows)))
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("update speed-up vs exact")
    axes[0].legend(title="measured (dashed: analytic)", fontsize=8)
    figure.suptitle(
        f"{sweep['backbone']} ({sweep['parameters'] / 1e6:.1f}M parameters), {report['device']}",
        fontsize=9,
    )
    figure.tight_layout()
    return save_figure(figure, path, dpi=100)


def format_report(report: dict[str, Any]) -> str:
    """The printed table: medians, spread, ratios beside the analytic predictions."""
    lines = [
        f"device: {report['device']}; torch {report['torch']}",
        "speed-up: exact's update seconds over the case's, per repeat (median [quartiles]); "
        "analytic: forward-equivalents; rows: rows with grad (exact steps and anchors); "
        "memory: (weights + grads + AdamW moments + peak "
        "activations saved for backward) vs exact",
    ]
    for backbone in report["backbones"]:
        lines += [
            "",
            f"{backbone['backbone']}: {backbone['parameters'] / 1e6:.2f}M parameters, latents "
            f"{backbone['latent_shape']}, trained steps {len(backbone['trained_steps'])}, "
            f"batch {report['settings']['batch']}",
            f"{'case':<46} {'update s':>9} {'fwd':>6} {'bwd':>6} {'opt':>6} {'speed-up':>9} "
            f"{'[q1, q3]':>13} {'analytic':>8} {'rows':>4} {'bwd calls':>9} {'fwd calls':>9} "
            f"{'act. MB':>8} {'memory':>7}",
        ]
        for row in backbone["cases"]:
            s, r = row["seconds"], row["speedup"]
            lines.append(
                f"{row['case']:<46} {s['update']['median']:>9.3f} {s['forward']['median']:>6.3f} "
                f"{s['backward']['median']:>6.3f} {s['optimizer']['median']:>6.3f} "
                f"{r['median']:>8.2f}x [{r['q1']:>5.2f}, {r['q3']:>5.2f}] "
                f"{row['predicted_speedup']:>7.2f}x {row['analytic_rows']:>4} "
                f"{row['backward_calls']:>9} "
                f"{row['network_calls']:>9} {row['peak_activation_bytes'] / 2**20:>8.1f} "
                f"{row['memory_vs_exact']:>6.2f}x"
            )
        if "round" in backbone:
            whole = backbone["round"]
            gains = ", ".join(f"{c}: {x:.2f}x" for c, x in whole["round_speedup"].items())
            lines.append(
                f"whole round (rollout {whole['rollout']:.3f} s + score {whole['score']:.3f} s "
                f"+ update): {gains}"
            )
    if "reduce_scatters" in report:
        rs = report["reduce_scatters"]
        lines += [
            "",
            f"FSDP2 reduce-scatters per optimizer step on {rs['world_size']} ranks (gloo, "
            f"{rs['groups']} parameter groups): "
            + ", ".join(f"{mode}: {n}" for mode, n in rs["per_step"].items()),
        ]
    return "\n".join(lines)
