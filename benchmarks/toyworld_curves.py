"""Learning curves of GRPO on the toy world: held-out reward vs round, per gradient mode.

Runs every (variant, seed) of the default experiment in its own process (``--workers`` at a
time, one torch thread each) through :func:`jagg_pipeline.stages.loop.run_rounds`, evaluating the
held-out prompts (``eval`` section) every ``--every`` rounds. Each run appends one JSON line
per round to ``OUT/<variant>/seed-<s>/rounds.jsonl`` and writes ``done.json`` last, so an
interrupted benchmark resumes where it stopped. Then it writes ``OUT/curves.json`` (every
number), ``OUT/table.md`` (base -> final held-out attribute reward and toy CLIPScore, mean and
std over seeds; update-stage seconds per round) and ``OUT/curves.png``.

    python benchmarks/toyworld_curves.py --world results/toyworld --out results/curves

The variants are overrides of the package's default config (which is the tuned setting):
exact, jagg (jagg_frac 1, the rollout's velocities reused), jagg_recompute (reuse off),
jagg_shared (shared anchors), jagg_0.6, no_interp_drop, no_interp_nearest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "exact": {"mode": "exact"},
    "jagg": {"mode": "jagg", "jagg_frac": 1.0},
    "jagg_recompute": {"mode": "jagg", "jagg_frac": 1.0, "reuse_velocities": False},
    "jagg_shared": {"mode": "jagg", "jagg_frac": 1.0, "anchors": "shared"},
    "jagg_0.6": {"mode": "jagg", "jagg_frac": 0.6},
    "no_interp_drop": {"mode": "no_interp", "no_interp": "drop"},
    "no_interp_nearest": {"mode": "no_interp", "no_interp": "nearest"},
}
METRICS = ("toy_attributes", "toy_clipscore")


def experiment(world: Path, variant: str, seed: int, rounds: int | None) -> Any:
    """The default config pointed at ``world``, with ``variant``'s jagg section and ``seed``."""
    from jagg_pipeline.config.run import from_mapping
    from jagg_pipeline.toyworld.config import experiment_sections

    train: dict[str, Any] = {"seed": seed}
    if rounds is not None:
        train["rounds"] = rounds
    return from_mapping({**experiment_sections(world), "jagg": VARIANTS[variant], "train": train})


def run_one(args: argparse.Namespace) -> None:
    """One (variant, seed): rounds with held-out evaluation, one JSON line per round."""
    import shutil
    import tempfile

    import torch

    from jagg_pipeline.io.artifacts import round_name
    from jagg_pipeline.stages.loop import run_rounds

    torch.set_num_threads(1)
    config = experiment(args.world, args.variant, args.seed, args.rounds)
    run_dir = args.out / args.variant / f"seed-{args.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "rounds.jsonl"
    log.write_text("")
    work = Path(tempfile.mkdtemp(prefix="curves-"))
    started = time.perf_counter()

    def record(done: Any) -> None:
        row = {
            "round": done.round,
            "train_reward": done.reward_mean,
            "round_seconds": done.round_seconds,
            "stage_seconds": done.stage_seconds,
            "update_seconds": done.update_seconds,
            "evaluation": done.evaluation,
            "elapsed": time.perf_counter() - started,
        }
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        # Only the latest checkpoint is needed to go on.
        previous = work / round_name(done.round - 1)
        shutil.rmtree(previous, ignore_errors=True)

    try:
        run_rounds(config, work, evaluate_every=args.every, on_round=record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (run_dir / "done.json").write_text(json.dumps({"seconds": time.perf_counter() - started}))


def read_runs(out: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """``runs[variant][seed]`` = the rows of every finished run under ``out``."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for variant in VARIANTS:
        for run_dir in sorted((out / variant).glob("seed-*")):
            if (run_dir / "done.json").is_file():
                rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").open()]
                runs.setdefault(variant, {})[int(run_dir.name[5:])] = rows
    return runs


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per variant: evaluated rounds with mean/std per metric, base and final, timings."""
    summary: dict[str, Any] = {}
    for variant, seeds in runs.items():
        evaluated = [r["round"] for r in next(iter(seeds.values())) if r["evaluation"]]
        curves = {
            m: [
                _mean_std(
                    [
                        next(r for r in rows if r["round"] == k)["evaluation"][m]
                        for rows in seeds.values()
                    ]
                )
                for k in evaluated
            ]
            for m in METRICS
        }
        trained = [r for rows in seeds.values() for r in rows if r["update_seconds"]]
        update = {
            part: statistics.mean(r["update_seconds"][part] for r in trained)
            for part in ("forward", "backward", "optimizer")
        }
        finals = {m: [rows[-1]["evaluation"][m] for rows in seeds.values()] for m in METRICS}
        bases = {m: [rows[0]["evaluation"][m] for rows in seeds.values()] for m in METRICS}
        rises = [
            f - b for f, b in zip(finals["toy_attributes"], bases["toy_attributes"], strict=True)
        ]
        summary[variant] = {
            "seeds": sorted(seeds),
            "rounds": evaluated,
            "curves": {m: [list(c) for c in curve] for m, curve in curves.items()},
            "base": {m: _mean_std(v) for m, v in bases.items()},
            "final": {m: _mean_std(v) for m, v in finals.items()},
            "rise": _mean_std(rises),
            "update_seconds_per_round": update,
            "round_seconds": statistics.mean(r["round_seconds"] for r in trained),
            "stage_seconds": {
                stage: statistics.mean(r["stage_seconds"][stage] for r in trained)
                for stage in ("rollout", "score", "train")
            },
            "train_seconds": statistics.mean(rows[-1]["elapsed"] for rows in seeds.values()),
        }
    return summary


def table(summary: dict[str, Any]) -> str:
    """A markdown table of base -> final per variant."""
    lines = [
        "| variant | held-out attribute reward: base -> final | rise (std over seeds) "
        "| toy CLIPScore: base -> final | update s/round (fwd + bwd + opt) "
        "| round s (rollout + score + train) | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, s in summary.items():
        (ab, _), (af, afs) = s["base"]["toy_attributes"], s["final"]["toy_attributes"]
        (cb, _), (cf, cfs) = s["base"]["toy_clipscore"], s["final"]["toy_clipscore"]
        u, stage = s["update_seconds_per_round"], s["stage_seconds"]
        lines.append(
            f"| {variant} | {ab:.3f} -> {af:.3f} +- {afs:.3f} | {s['rise'][0]:+.3f} "
            f"({s['rise'][1]:.3f}) | {cb:.1f} -> {cf:.1f} +- {cfs:.1f} "
            f"| {sum(u.values()):.2f} ({u['forward']:.2f} + {u['backward']:.2f} + "
            f"{u['optimizer']:.2f}) | {s['round_seconds']:.1f} ({stage['rollout']:.1f} + "
            f"{stage['score']:.1f} + {stage['train']:.1f}) | {len(s['seeds'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Two panels (attribute reward, toy CLIPScore) vs round: seed mean and +-1 std band."""
    from jagg_pipeline.io.figures import pyplot, save_figure

    figure, axes = pyplot().subplots(1, 2, figsize=(11, 4), dpi=100)
    titles = {
        "toy_attributes": "held-out attribute reward",
        "toy_clipscore": "held-out toy CLIPScore",
    }
    for variant, s in summary.items():
        for axis, metric in zip(axes, METRICS, strict=True):
            mean = [c[0] for c in s["curves"][metric]]
            std = [c[1] for c in s["curves"][metric]]
            (line,) = axis.plot(s["rounds"], mean, marker="o", markersize=3, label=variant)
            low = [m - d for m, d in zip(mean, std, strict=True)]
            high = [m + d for m, d in zip(mean, std, strict=True)]
            axis.fill_between(s["rounds"], low, high, color=line.get_color(), alpha=0.15)
    for axis, metric in zip(axes, METRICS, strict=True):
        axis.set_title(titles[metric])
        axis.set_xlabel("round")
        axis.grid(alpha=0.3)
    seeds = max(len(s["seeds"]) for s in summary.values())
    axes[0].legend(title=f"mean +- std, {seeds} seeds")
    figure.tight_layout()
    save_figure(figure, path)


def main() -> None:
    """Run the missing (variant, seed) runs, then summarise every finished one."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--world", type=Path, default=Path("results/toyworld"), help="a built toy world"
    )
    parser.add_argument("--out", type=Path, default=Path("results/curves"), help="output folder")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=None, help="default: train.rounds")
    parser.add_argument("--every", type=int, default=10, help="evaluate every K rounds")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        run_one(args)
        return

    todo = [
        (v, s)
        for v in args.variants
        for s in args.seeds
        if not (args.out / v / f"seed-{s}" / "done.json").is_file()
    ]
    common = ["--world", str(args.world), "--out", str(args.out), "--every", str(args.every)]
    if args.rounds is not None:
        common += ["--rounds", str(args.rounds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    running: list[tuple[subprocess.Popen, str]] = []
    failed = []
    while todo or running:
        while todo and len(running) < args.workers:
            variant, seed = todo.pop(0)
            cmd = [sys.executable, __file__, *common, "--variant", variant, "--seed", str(seed)]
            running.append((subprocess.Popen(cmd, env=env), f"{variant} seed {seed}"))
            print(f"started {running[-1][1]}", flush=True)
        time.sleep(2)
        for proc, name in list(running):
            if proc.poll() is not None:
                running.remove((proc, name))
                print(f"finished {name} (exit {proc.returncode})", flush=True)
                if proc.returncode != 0:
                    failed.append(name)
    summary = summarise(read_runs(args.out))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curves.json").write_text(json.dumps(summary, indent=1))
    (args.out / "table.md").write_text(table(summary))
    plot(summary, args.out / "curves.png")
    print(table(summary))
    if failed:
        sys.exit(f"failed runs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
