"""``bench``: the update stage's speed, exact vs JAGG (with and without reuse) vs no_interp."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

HELP = "time the update stage of every gradient mode side by side (speed-ups vs analytic)"


def _numbers(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(item) for item in text.split(",") if item]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s") from None

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    from jagg_pipeline.bench.config import BENCH_BACKBONES, BenchConfig

    defaults = BenchConfig()
    p = sub.add_parser(
        "bench",
        help=HELP,
        description=(
            "Samples one trajectory batch per backbone (velocities recorded, as a rollout "
            "stores them), then times one optimizer step's update (forward, backward, "
            "optimizer) of exact, jagg and jagg with the rollout's velocities reused (each "
            "with the joint and the sequential endpoint backward), no_interp, and jagg with "
            "shared anchors (adjacent windows share their boundary step) on it, "
            "interleaved after a warm-up at a fixed thread count: medians, quartiles, "
            "speed-ups over exact beside the analytic prediction, network calls, peak "
            "activation memory. The W x jagg_frac sweep runs on --sweep-backbone; a "
            "whole round (rollout + score + update) gives the per-round gain; a torchrun "
            "run on --ranks gloo processes counts FSDP2 reduce-scatters per optimizer step. "
            "Writes bench.json, bench.csv and speedup.png into --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backbones",
        type=_numbers(str),
        default=",".join(defaults.backbones),
        help=f"comma-separated, from {', '.join(BENCH_BACKBONES)} (wide-flux: width 256)",
    )
    p.add_argument("--sweep-backbone", default=defaults.sweep_backbone, help="the sweep's backbone")
    p.add_argument(
        "--windows",
        type=_numbers(int),
        default=",".join(map(str, defaults.windows)),
        help="W values of the sweep",
    )
    p.add_argument(
        "--fracs",
        type=_numbers(float),
        default=",".join(map(str, defaults.fracs)),
        help="jagg_frac values of the sweep",
    )
    p.add_argument("--window", type=int, default=defaults.window, help="the headline W")
    p.add_argument("--batch", type=int, default=defaults.batch, help="samples per update")
    p.add_argument(
        "--steps",
        type=int,
        default=defaults.num_steps,
        help="denoising steps (all but the last trained)",
    )
    p.add_argument(
        "--long-steps",
        type=int,
        default=defaults.long_steps,
        help="the headline cases again on the sweep backbone with this many denoising steps "
        "(0: skip)",
    )
    p.add_argument("--repeats", type=int, default=defaults.repeats, help="timed passes per case")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed passes first")
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch threads")
    p.add_argument("--device", default=defaults.device, help="cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=defaults.seed, help="weights and data seed")
    p.add_argument(
        "--no-round", action="store_true", help="skip the whole-round (rollout + score) timing"
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=defaults.ranks,
        help="processes of the reduce-scatter count (1: skip)",
    )
    p.add_argument("--out", type=Path, default=Path("results/bench"), help="output folder")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.bench.config import BenchConfig
    from jagg_pipeline.bench.measure import run_bench
    from jagg_pipeline.bench.report import format_report, write_outputs

    settings = BenchConfig(
        backbones=args.backbones,
        sweep_backbone=args.sweep_backbone,
        windows=args.windows,
        fracs=args.fracs,
        window=args.window,
        batch=args.batch,
        num_steps=args.steps,
        long_steps=args.long_steps,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        device=args.device,
        seed=args.seed,
        whole_round=not args.no_round,
        ranks=args.ranks,
    )
    try:
        report = run_bench(settings)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(format_report(report))
    paths = write_outputs(report, args.out)
    print(f"written: {', '.join(str(p) for p in paths.values())}")
    return 0
