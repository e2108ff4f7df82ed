"""``score-images``: score a folder of images against their prompts with rewards.

Inputs are resolved to (image file, prompt) pairs, the images are scored in batches of equal
size, and one table row per image is written atomically (csv, jsonl or parquet) with a JSON
manifest beside it. The pipeline's score stage on a rollout is ``score``
(:mod:`jagg_pipeline.cli.score`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The command name (the module name has an underscore).
NAME = "score-images"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass
class Sample:
    """One image to score: its file, the name written to the table, its prompt."""

    path: Path
    name: str
    prompt: str


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
    if args.images is None or (args.prompts is None and args.manifest is None):
        raise SystemExit("error: give --images DIR with --prompts FILE or --manifest FILE")
    return _run_score(args)


def _rewards_section(args: argparse.Namespace) -> dict[str, Any]:
    section: dict[str, Any] = {}
    if args.rewards is not None:
        import yaml

        loaded = yaml.safe_load(args.rewards.read_text(encoding="utf-8"))
        if isinstance(loaded, dict) and "rewards" in loaded:
            loaded = loaded["rewards"]
        if not isinstance(loaded, dict):
            raise SystemExit(f"error: {args.rewards}: expected a mapping of reward settings")
        section = dict(loaded)
    if args.reward:
        section["weights"] = dict(args.reward)
    if args.normalize_separately is not None:
        section["normalize_separately"] = args.normalize_separately
    outside = [item for item in args.overrides if not item.startswith("rewards.")]
    if outside:
        raise SystemExit(f"error: --set {outside[0]}: only rewards.* keys apply to images")
    from jagg_pipeline.config.tools import ConfigError, apply_overrides

    try:
        return apply_overrides({"rewards": section}, args.overrides)["rewards"]
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None


def _image_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise SystemExit(f"error: --images {folder}: no such folder")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def _samples(args: argparse.Namespace) -> list[Sample]:
    from jagg_pipeline.io.prompts import column_values, load_prompts, read_table

    if args.prompts is not None:
        prompts = load_prompts(args.prompts, args.column)
        files = _image_files(args.images)
        k = args.images_per_prompt
        if k < 1 or len(files) != k * len(prompts):
            raise SystemExit(
                f"error: {len(files)} images in {args.images} but {len(prompts)} prompts in "
                f"{args.prompts} with --images-per-prompt {k}: need {k * len(prompts)}"
            )
        return [Sample(f, f.name, prompts[i // k]) for i, f in enumerate(files)]
    rows = read_table(args.manifest)
    names = column_values(args.manifest, rows, args.image_column)
    prompts = column_values(args.manifest, rows, args.column or "prompt")
    pairs = zip(names, prompts, strict=True)
    samples = [Sample(args.images / str(n), str(n), str(p)) for n, p in pairs]
    missing = [s.name for s in samples if not s.path.is_file()]
    if missing:
        raise SystemExit(
            f"error: {len(missing)} images of {args.manifest} not found in {args.images}, "
            f"e.g. {missing[0]}"
        )
    return samples


def _score_columns(reward: Any, samples: list[Sample], batch_size: int) -> dict[str, Any]:
    """Score every sample; images of one size are batched together, rows keep input order."""
    import torch
    from PIL import Image

    from jagg_pipeline.rewards import to_unit_float

    by_size: dict[tuple[int, int], list[int]] = {}
    for index, sample in enumerate(samples):
        try:
            with Image.open(sample.path) as image:
                image.verify()  # a truncated or non-image file fails here, before any scoring
                by_size.setdefault(image.size, []).append(index)
        except (OSError, SyntaxError) as err:  # PIL raises both for unreadable images
            raise SystemExit(f"error: {sample.path}: not a readable image ({err})") from None
    columns = {name: torch.empty(len(samples)) for name in reward.rewards}
    for indices in by_size.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            images = []
            for i in chunk:
                with Image.open(samples[i].path) as image:
                    images.append(image.convert("RGB"))
            scores = reward.columns(to_unit_float(images), [samples[i].prompt for i in chunk])
            for name, values in scores.items():
                columns[name][chunk] = values.cpu()
    return columns


def _run_score(args: argparse.Namespace) -> int:
    import torch

    from jagg_pipeline import __version__
    from jagg_pipeline.config.tools import to_dict
    from jagg_pipeline.io.artifacts import atomic_write_json
    from jagg_pipeline.io.manifest import file_sha256
    from jagg_pipeline.io.prompts import PromptFileError
    from jagg_pipeline.io.tables import WRITE_SUFFIXES, write_table
    from jagg_pipeline.rewards import MultiReward, RewardConfigError, parse_rewards

    if args.out.suffix.lower() not in WRITE_SUFFIXES:
        raise SystemExit(f"error: --out {args.out}: use one of {', '.join(WRITE_SUFFIXES)}")
    if args.batch_size < 1:
        raise SystemExit(f"error: --batch-size must be >= 1, got {args.batch_size}")
    if args.rewards is None and not args.reward:
        raise SystemExit("error: name the rewards with --rewards FILE or --reward NAME[=WEIGHT]")
    try:
        spec = parse_rewards(_rewards_section(args))
        samples = _samples(args)
        reward = MultiReward.from_spec(spec, args.device)
    except (RewardConfigError, PromptFileError) as err:
        raise SystemExit(f"error: {err}") from None
    if not samples:
        raise SystemExit(f"error: no images to score in {args.images}")
    columns = _score_columns(reward, samples, args.batch_size)
    groups: dict[str, int] = {}
    group_ids = torch.tensor([groups.setdefault(s.prompt, len(groups)) for s in samples])
    result = reward.combine(columns, group_ids)
    rows = [
        {
            "image": sample.name,
            "prompt": sample.prompt,
            "group": int(group_ids[i]),
            **{name: float(values[i]) for name, values in result.columns.items()},
            "total": float(result.total[i]),
            "advantage": float(result.advantages[i]),
        }
        for i, sample in enumerate(samples)
    ]
    write_table(args.out, rows)
    text_inputs = [p for p in (args.prompts, args.manifest, args.rewards) if p is not None]
    image_digest = hashlib.sha256()
    for sample in samples:
        image_digest.update(f"{sample.name}\0{file_sha256(sample.path)}\n".encode())
    manifest = {
        "command": "score",
        "version": __version__,
        "rewards": to_dict(spec),
        "device": args.device,
        "inputs": {
            "images": str(args.images),
            "images_sha256": image_digest.hexdigest(),
            "files_sha256": {str(p): file_sha256(p) for p in text_inputs},
        },
        "rows": len(rows),
        "table": args.out.name,
    }
    atomic_write_json(args.out.with_name(args.out.name + ".manifest.json"), manifest)
    print(f"scored {len(rows)} images with {', '.join(spec.weights)}; table written to {args.out}")
    return 0
