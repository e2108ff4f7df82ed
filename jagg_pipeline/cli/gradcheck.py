"""``gradcheck``: per-window agreement of the JAGG and no-interp gradients with the exact one."""

from __future__ import annotations

import argparse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _window(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {value}")
    return value


# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "compare JAGG and no-interp gradients with the exact GRPO gradient, per window"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``gradcheck`` subcommand."""
    from jagg_pipeline.bench.gradcheck_config import (
        BACKBONES,
        DTYPE_NAMES,
        TRAJECTORIES,
        GradcheckConfig,
    )
    from jagg_pipeline.core.options import option_choices, option_help

    defaults = GradcheckConfig()
    p = sub.add_parser(
        "gradcheck",
        help=HELP,
        description=(
            "Build a trajectory batch on a backbone, a GRPO objective on it, and report for each "
            "window of trained steps the cosine similarity and relative error of the jagg and "
            "no_interp gradients against the exact one, plus the network backward calls each "
            "mode spends on the whole trajectory, for both anchor layouts (separate: each "
            "window its own two ends; shared: adjacent windows share their boundary step). On "
            "--backbone affine --trajectory chord "
            "--dtype float64 JAGG is exact (rel_err ~1e-15); SDE noise or a nonlinear backbone "
            "makes it approximate."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backbone",
        choices=BACKBONES,
        default=defaults.backbone,
        help="velocity model: 'affine' (J affine in (z, t): JAGG exact on the chord), "
        "'mlp-dit' (a tiny nonlinear DiT), or 'tiny-flux'/'tiny-sd3'/'tiny-qwenimage' (a tiny "
        "random diffusers checkpoint built in a temporary directory and driven through its "
        "backbone adapter, with the checkpoint's own sigma schedule)",
    )
    p.add_argument(
        "--window", type=_window, default=defaults.window, help="W, trained steps per window (>= 2)"
    )
    p.add_argument(
        "--trajectory",
        choices=TRAJECTORIES,
        default=defaults.trajectory,
        help="'chord': the straight path (1 - sigma) x0 + sigma eps; 'sde': a Flow-GRPO SDE "
        "rollout of the backbone (off the chord)",
    )
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=defaults.dtype, help="model precision")
    p.add_argument(
        "--jagg-frac",
        type=_fraction,
        default=defaults.jagg_frac,
        help="fraction of windows (from high noise) routed to jagg/no_interp for the "
        "whole-trajectory comparison and the backward-call count; the rest are exact",
    )
    p.add_argument("--steps", type=int, default=defaults.num_steps, help="denoising steps")
    p.add_argument("--batch", type=int, default=defaults.batch, help="samples in the batch")
    p.add_argument(
        "--shift",
        type=float,
        default=defaults.shift,
        help="static schedule shift (analytic backbones; tiny-* use their checkpoint's scheduler)",
    )
    for option in ("weights", "no_interp", "endpoint_backward"):
        p.add_argument(
            f"--{option.replace('_', '-')}",
            choices=option_choices(option),
            default=getattr(defaults, option),
            help=option_help(option),
        )
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed for model and data")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument(
        "--max-rel-err",
        type=float,
        metavar="X",
        help="exit with status 1 if any window's jagg rel_err exceeds X (for scripts and CI)",
    )
    p.set_defaults(handler=_run_gradcheck)


def _run_gradcheck(args: argparse.Namespace) -> int:
    import torch

    from jagg_pipeline.bench.gradcheck import GradcheckConfig, run_gradcheck
    from jagg_pipeline.bench.gradcheck_report import format_report, worst_rel_err
    from jagg_pipeline.io.artifacts import atomic_write_json

    torch.set_num_threads(1)
    settings = GradcheckConfig(
        backbone=args.backbone,
        window=args.window,
        trajectory=args.trajectory,
        dtype=args.dtype,
        jagg_frac=args.jagg_frac,
        num_steps=args.steps,
        batch=args.batch,
        shift=args.shift,
        weights=args.weights,
        no_interp=args.no_interp,
        endpoint_backward=args.endpoint_backward,
        seed=args.seed,
    )
    report = run_gradcheck(settings)
    print(format_report(report))
    if args.json:
        print(f"report written to {atomic_write_json(args.json, report)}")
    if args.max_rel_err is not None:
        worst = worst_rel_err(report)
        if not worst <= args.max_rel_err:
            print(f"FAIL: worst window jagg rel_err {worst:.3e} > {args.max_rel_err:.3e}")
            return 1
        print(f"OK: worst window jagg rel_err {worst:.3e} <= {args.max_rel_err:.3e}")
    return 0
