"""``export``: a checkpoint's policy in a hub format (a diffusers folder or a peft adapter)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from jagg_pipeline.cli.common import add_config_arguments, load_stage_config, stage_errors

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "write a checkpoint's policy as a diffusers folder (full) or a peft adapter (LoRA)"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand."""
    p = sub.add_parser(
        "export",
        help=HELP,
        description=textwrap.dedent(
            """\
            Read a training checkpoint's sharded policy into one process and write it in the
            format other tools load. backbone.training: full gives a diffusers pipeline
            folder (the base checkpoint's components, the trained transformer/ in its
            place), usable as backbone.path or with DiffusionPipeline.from_pretrained;
            lora gives an adapter folder for the base model that both
            pipe.load_lora_weights(DIR) and peft's PeftModel.from_pretrained(transformer, DIR)
            read (adapter_config.json, adapter_model.safetensors,
            pytorch_lora_weights.safetensors). Needs host memory for the whole
            model once; the training checkpoints themselves stay sharded.

            The folder also holds manifest.json (stage "export", its kind, the
            checkpoint it came from, every file's digest), which the loaders ignore and
            which marks it as an export. --out must be new, an empty folder, or a
            previous export of the same kind, which is replaced; anything else (a
            folder of yours, the checkpoint or a folder holding it, a run folder, the
            current folder, a file, an export of the other kind) is refused, untouched."""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument(
        "--policy", type=Path, required=True, metavar="CKPT", help="a training checkpoint"
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="output folder: a new path, an empty folder or a previous export of the same kind",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.io.exports import DestinationError
    from jagg_pipeline.stages.policy import export_policy

    config = load_stage_config(args.config, args.overrides)
    with stage_errors():
        try:
            export = export_policy(config, args.policy, args.out)
        except DestinationError as err:  # a refused --out: the command's own one-line form
            raise SystemExit(f"export: {err}") from None
    replaced = f"; replaced the previous export at {export.path}" if export.replaced else ""
    print(f"{args.policy} exported to {args.out}{replaced}")
    return 0
