"""``block``: consecutive GRPO rounds of one run in one job, the models resident.

Where a block writes is the run folder's layout (:mod:`jagg_pipeline.workflow.layout`), the
one the single-round jobs of the workflow write: ``RUN/round-<r>/{scores,rollout,checkpoint}``,
``RUN/round-<r>/metrics/<stage>.jsonl`` and ``RUN/eval/trained-<n>``; the block's last
checkpoint goes where ``--checkpoint`` says (the workflow's transient folder when the round
keeps none).
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jagg_pipeline.cli.common import (
    add_conditioning_argument,
    add_config_arguments,
    add_policy_argument,
    add_prompt_arguments,
    load_stage_config,
    stage_errors,
)

if TYPE_CHECKING:
    from jagg_pipeline.stages.block import BlockOutputs

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "run consecutive rounds (sample, score, train) in one job, the models resident"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``block`` subcommand."""
    p = sub.add_parser(
        "block",
        help=HELP,
        description=textwrap.dedent(
            """\
            Run rounds FIRST..LAST of one run in one process group: each round samples a
            rollout (every rank its share, the policy FSDP2-sharded), scores it (rank 0, the
            reward models loaded once) and trains on it, the rollout and scores passed in
            memory. Writes what the single-round commands (rollout, score, train, evaluate)
            write for these rounds, bit for bit: every round's score folder and metric lines,
            the rollout and checkpoint of the --keep rounds, the checkpoint of round LAST
            (--checkpoint) and the --evaluate evaluations; then --record, last. Run it as one
            process or under `torchrun --nproc_per_node N`. Rerun after a kill, it resumes
            after the last complete checkpoint it wrote."""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    add_policy_argument(p, "'base' (round 0) or the checkpoint after FIRST rounds")
    add_prompt_arguments(p, "sampler.prompt_column")
    add_conditioning_argument(p, "the training prompt pool")
    p.add_argument(
        "--eval-conditioning",
        type=Path,
        metavar="DIR",
        help="the `encode` output of eval.prompts, for the --evaluate evaluations (default: "
        "encode them inline)",
    )
    # Not --run: torchrun, which starts this command, would take it for its --run-path.
    p.add_argument("--run-dir", type=Path, required=True, metavar="DIR", help="the run's folder")
    p.add_argument(
        "--rounds",
        type=int,
        nargs=2,
        required=True,
        metavar=("FIRST", "LAST"),
        help="the block's first and last round (inclusive)",
    )
    p.add_argument(
        "--keep",
        type=int,
        nargs="*",
        default=[],
        metavar="R",
        help="rounds whose rollout and checkpoint are kept (round-<r>/rollout, checkpoint)",
    )
    p.add_argument(
        "--evaluate",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="evaluate the policy after N trained rounds (FIRST <= N <= LAST + 1) into "
        "eval/trained-<N>",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        metavar="DIR",
        help="where round LAST's checkpoint goes (the next block's --policy)",
    )
    p.add_argument(
        "--record", type=Path, required=True, metavar="FILE", help="the block's record (JSON)"
    )
    p.set_defaults(handler=_run)


def block_outputs(
    run_dir: Path,
    first: int,
    last: int,
    *,
    keep: Sequence[int] = (),
    evaluate: Sequence[int] = (),
    checkpoint: Path,
    record: Path,
) -> BlockOutputs:
    """The paths of a block's outputs in its run folder (see the module docstring)."""
    from jagg_pipeline.stages.block import BlockOutputs, RoundOutputs
    from jagg_pipeline.workflow import layout

    if not 0 <= first <= last:
        raise SystemExit(f"error: --rounds {first} {last}: need 0 <= FIRST <= LAST")
    outside = [n for n in evaluate if not first <= n <= last + 1]
    if outside:
        raise SystemExit(
            f"error: --evaluate {outside}: a block evaluates after {first}..{last + 1} rounds"
        )
    run = str(run_dir)
    rounds = {}
    for round_index in range(first, last + 1):
        folder = Path(layout.round_folder(run, round_index))
        kept = round_index in keep
        kept_checkpoint = Path(layout.stage_folder(run, round_index, "checkpoint", kept=True))
        written = kept_checkpoint if kept else None
        if round_index == last:
            written = checkpoint
        rounds[round_index] = RoundOutputs(
            folder=folder,
            scores=Path(layout.scores_folder(run, round_index)),
            rollout=Path(layout.stage_folder(run, round_index, "rollout", kept=True))
            if kept
            else None,
            checkpoint=written,
            policy_name=str(written or f"{kept_checkpoint} (in memory)"),
        )
    evaluations = {n: Path(layout.evaluation_folder(run, n)) for n in sorted(evaluate)}
    return BlockOutputs(rounds, evaluations, record)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.stages.block import run_block
    from jagg_pipeline.stages.checkpoint import NonFiniteError

    config = load_stage_config(args.config, args.overrides)
    first, last = args.rounds
    outputs = block_outputs(
        args.run_dir,
        first,
        last,
        keep=args.keep,
        evaluate=args.evaluate,
        checkpoint=args.checkpoint,
        record=args.record,
    )
    with stage_errors():
        try:
            run_block(
                config,
                args.policy,
                outputs,
                prompts=args.prompts or config.sampler.prompts,
                column=args.column or config.sampler.prompt_column,
                conditioning=args.conditioning,
                eval_conditioning=args.eval_conditioning,
            )
        except NonFiniteError as err:
            raise SystemExit(f"error: {err}") from None
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, say it once
        print(f"rounds {args.rounds[0]}-{args.rounds[1]} written under {args.run_dir}")
    return 0
