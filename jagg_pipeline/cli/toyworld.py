"""``toyworld build|clip|pretrain``: build the embedded toy world (toy DiT, toy CLIP, report).

``clip`` builds only the toy CLIP, so that builds of several families (the workflow runs them
in parallel) share one CLIP instead of racing to write it. ``pretrain`` does the backbone's part
that needs no CLIP (into ``OUT/pretrain-<family>/``), so that it runs beside the CLIP's job;
``build`` then finishes from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "build the embedded toy world: a pretrained toy DiT, the toy CLIP, a report"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``toyworld`` subcommand."""
    from jagg_pipeline.toyworld.config import TOY_FAMILIES, BuildConfig

    defaults = BuildConfig()
    p = sub.add_parser(
        "toyworld",
        help=HELP,
        description=(
            "Pretrains a toy backbone (the real diffusers transformer class of the family in a "
            "tiny config, with word-level text encoders and a lossless pixel-unshuffle codec as "
            "its VAE) by rectified-flow matching on procedurally drawn shapes, and trains a "
            "toy CLIP contrastively (reused across builds with the same settings). Writes "
            "OUT/<family>/ (diffusers checkpoint), OUT/clip/ (transformers CLIP), "
            "OUT/report-<family>.json (attribute reward of random init, base policy and data; "
            "CLIP top-1 retrieval), OUT/samples-<family>.png and OUT/loss-<family>.png. "
            "Deterministic: the same seed gives bit-identical weights on CPU."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "action",
        choices=("build", "clip", "pretrain"),
        help="build: the CLIP (unless built with these settings) and the backbone (finishing "
        "from OUT/pretrain-<family>/ if pretrain made it with these settings); clip: the CLIP "
        "only; pretrain: the backbone's pretraining and samples, into OUT/pretrain-<family>/",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--backbone", choices=TOY_FAMILIES, default=defaults.family, help="DiT family to build"
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of weights and data")
    p.add_argument(
        "--steps", type=int, default=defaults.pretrain.steps, help="backbone pretraining steps"
    )
    p.add_argument(
        "--batch", type=int, default=defaults.pretrain.batch, help="pretraining batch size"
    )
    p.add_argument(
        "--clip-steps", type=int, default=defaults.clip.steps, help="toy CLIP training steps"
    )
    p.add_argument(
        "--eval-steps", type=int, default=defaults.eval_steps, help="ODE steps for the report"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from jagg_pipeline.io.tables import format_number
    from jagg_pipeline.toyworld.build import build_toyworld, ensure_clip, pretrain_backbone
    from jagg_pipeline.toyworld.config import BuildConfig

    torch.set_num_threads(1)
    defaults = BuildConfig()
    settings = BuildConfig(
        family=args.backbone,
        seed=args.seed,
        pretrain=dataclasses.replace(defaults.pretrain, steps=args.steps, batch=args.batch),
        clip=dataclasses.replace(defaults.clip, steps=args.clip_steps, seed=args.seed),
        eval_steps=args.eval_steps,
    )
    if args.action == "clip":
        clip = ensure_clip(args.out, settings.clip, progress=not args.quiet)
        print(
            f"toy CLIP in {args.out / 'clip'}: top-1 among 16 held-out captions "
            f"{clip['top1_16']:.3f}"
        )
        return 0
    if args.action == "pretrain":
        staged = pretrain_backbone(args.out, settings, progress=not args.quiet)
        print(f"toy {settings.family} pretrained into {staged}")
        return 0
    report = build_toyworld(args.out, settings, progress=not args.quiet)
    rows = [
        ("random init", report["random_init"]),
        ("base policy", report["base_policy"]),
        ("data", report["data"]),
    ]
    print(f"toy world {report['family']} (seed {report['seed']}) written to {args.out}")
    print(f"{'':12} {'attribute reward':>16} {'toy CLIPScore':>14}")
    for name, numbers in rows:
        reward = format_number(numbers["attribute_reward"], ">16.3f")
        print(f"{name:12} {reward} {format_number(numbers['toy_clipscore'], '>14.2f')}")
    print(
        f"toy CLIP top-1 among 16 held-out captions: {report['clip']['top1_16']:.3f}; "
        f"pretraining {report['pretrain']['seconds']:.0f} s, CLIP {report['clip']['seconds']:.0f} s"
    )
    return 0
