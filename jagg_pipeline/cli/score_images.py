"""``score-images``: score a folder of images against their prompts with rewards.

Only the arguments, the help and the call: pairing, scoring, the table and its manifest are
:mod:`jagg_pipeline.stages.score_images`. The pipeline's score stage on a rollout is
``score`` (:mod:`jagg_pipeline.cli.score`).
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from pathlib import Path

# The command name (the module name has an underscore).
NAME = "score-images"


def _reward_flag(text: str) -> tuple[str, float]:
    name, _, weight = text.partition("=")
    try:
        return name, float(weight) if weight else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME=WEIGHT, got {text!r}") from None


def _epilog() -> str:
    import typing

    from jagg_pipeline.config.run import REWARD_NAMES, RewardsConfig

    specs = typing.get_type_hints(RewardsConfig)
    fields = {f.name: f for f in dataclasses.fields(RewardsConfig)}
    lines = ["rewards (settings: --set rewards.NAME.FIELD=VALUE, or the rewards file):"]
    for name in REWARD_NAMES:
        lines.append(f"  {name}: {fields[name].metadata['help']}")
        for f in dataclasses.fields(specs[name]):
            lines.append(f"      {f.name} (default {f.default!r})")
    lines += [
        "",
        "model settings name a local path first (a save_pretrained directory, a checkpoint",
        "file) or a Hugging Face Hub id second; with HF_HUB_OFFLINE=1 only the local cache is",
        "searched, so a missing model fails at once with the config key to set.",
        "",
        "rewards file (YAML or JSON; either this mapping or a config with a 'rewards:' key):",
        "  weights: {hpsv21: 1.0, pickscore: 0.5}",
        "  normalize_separately: false",
        "  hpsv21: {checkpoint: /models/HPS_v2.1_compressed.pt}",
        "",
        "output table: one row per image with columns",
        "  image      the image file, relative to --images",
        "  prompt     its prompt",
        "  group      integer id shared by the images of one prompt (GRPO group)",
        "  <reward>   one column per reward (float32 scores)",
        "  total      sum of weight * reward",
        "  advantage  group-normalised total, or with normalize_separately the weighted sum",
        "             of each reward's group-normalised advantage",
        "Format from the --out suffix: .csv, .jsonl or .parquet (needs pyarrow). Beside it,",
        "OUT.manifest.json records the package version, the resolved reward settings and",
        "digests of the inputs.",
    ]
    return "\n".join(lines)


# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "score images against prompts with HPSv2.1, PickScore, CLIPScore, ... into a table"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``score-images`` subcommand."""
    p = sub.add_parser(
        NAME,
        help=HELP,
        description=textwrap.dedent(
            """\
            Score a folder of images against their prompts with one or more rewards and write
            one row per image. Images and prompts are paired either by a prompt file (images
            sorted by file name; image i gets prompt i // --images-per-prompt) or by a
            manifest table with an image and a prompt column. Images of different sizes are
            fine (they are batched by size). The pipeline's score stage on a rollout is the
            `score` command."""
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(p.add_argument_group("inputs"))
    _add_rewards(p.add_argument_group("rewards"))
    p.add_argument("--device", default="cpu", help="torch device for the models (default: cpu)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        metavar="N",
        help="images loaded and scored at once (each reward may chunk further; default: 32)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="TABLE",
        help="output table: .csv, .jsonl or .parquet",
    )
    p.set_defaults(handler=_run)


def _add_inputs(group: argparse._ArgumentGroup) -> None:
    """The images and how they pair with prompts."""
    group.add_argument(
        "--images",
        type=Path,
        metavar="DIR",
        help="folder of images (png, jpg, jpeg, webp, bmp); manifest paths are relative to it",
    )
    source = group.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help="prompt file: .txt (one per line), .json, .jsonl, .csv or .parquet",
    )
    source.add_argument(
        "--manifest",
        type=Path,
        metavar="FILE",
        help="table (.json, .jsonl, .csv, .parquet) mapping image file -> prompt",
    )
    group.add_argument(
        "--column",
        metavar="NAME",
        help="prompt column of a tabular --prompts or --manifest file (default: prompt)",
    )
    group.add_argument(
        "--image-column",
        default="image",
        metavar="NAME",
        help="image column of --manifest (default: image)",
    )
    group.add_argument(
        "--images-per-prompt",
        type=int,
        default=1,
        metavar="K",
        help="with --prompts: K consecutive images per prompt (default: 1)",
    )


def _add_rewards(group: argparse._ArgumentGroup) -> None:
    """Which rewards run, their weights and settings."""
    group.add_argument(
        "--rewards",
        type=Path,
        metavar="FILE",
        help="rewards section as YAML or JSON (see below)",
    )
    group.add_argument(
        "--reward",
        type=_reward_flag,
        action="append",
        metavar="NAME[=WEIGHT]",
        help="a reward to compute (weight 1 by default); repeat for several; replaces the "
        "weights of --rewards",
    )
    group.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one rewards key, as --set does in every command, e.g. "
        "rewards.hpsv21.checkpoint=/models/HPS_v2.1_compressed.pt; repeatable",
    )
    group.add_argument(
        "--normalize-separately",
        action="store_true",
        default=None,
        help="group-normalise each reward before the weighted sum (advantage column)",
    )


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.cli.common import stage_errors
    from jagg_pipeline.stages.score_images import ImageInputs, rewards_section, score_images

    if args.images is None or (args.prompts is None and args.manifest is None):
        raise SystemExit("error: give --images DIR with --prompts FILE or --manifest FILE")
    if args.rewards is None and not args.reward:
        raise SystemExit("error: name the rewards with --rewards FILE or --reward NAME[=WEIGHT]")
    with stage_errors():
        weights = dict(args.reward) if args.reward else None
        section = rewards_section(args.rewards, weights, args.normalize_separately, args.overrides)
        inputs = ImageInputs(
            args.images,
            prompts=args.prompts,
            manifest=args.manifest,
            column=args.column,
            image_column=args.image_column,
            images_per_prompt=args.images_per_prompt,
        )
        scores = score_images(
            inputs,
            section,
            args.out,
            device=args.device,
            batch_size=args.batch_size,
            rewards_file=args.rewards,
        )
    print(
        f"scored {len(scores.rows)} images with {', '.join(scores.rewards)}; "
        f"table written to {args.out}"
    )
    return 0
