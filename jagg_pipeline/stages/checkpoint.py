"""Training checkpoints on disk: sharded, written by every rank at once, atomically.

A round's checkpoint is the next round's ``--policy``::

    CKPT/manifest.json              stage "train" (written last; inputs: policy, rollouts, rewards)
    CKPT/config.yaml                the resolved config
    CKPT/policy/                    the trainable weights, sharded (:mod:`jagg_pipeline.io.shards`;
                                    what the policy is: :mod:`jagg_pipeline.stages.policy`)
    CKPT/trainer/state.json         round, optimizer steps, skipped steps, LR-scheduler state,
                                    routing (with the probed cos-sims), world size
    CKPT/trainer/optimizer/         AdamW state, sharded like the weights ("state.<param>.<name>",
                                    the param groups with the parameter names)
    CKPT/trainer/ema/               EMA of the trainable weights, sharded, when
                                    ``train.ema_decay`` is set
    CKPT/trainer/rng.safetensors    the trainer's random generator (minibatch shuffles)
    CKPT/metrics.jsonl              one flat line per optimizer step (artifacts.metrics_record)

Each rank writes the shards it holds and nothing else: no rank gathers the model or the
optimizer state, so saving needs no more host memory than training, and a checkpoint written
by N ranks is read back by any number (each reads the chunks its shards overlap). Everything
is written into ``.CKPT.partial`` beside the target and renamed into place by rank 0 at the
end, so nothing half-written ever appears under the final name, and a killed run's leftovers
are cleared by the rerun. Nothing non-finite is ever written. Each rank hashes its shards as it
writes them and sends the digests to rank 0, whose manifest so reads no file back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.io import shards
from jagg_pipeline.io.artifacts import (
    METRICS_NAME,
    atomic_directory,
    atomic_write_safetensors,
    atomic_write_text,
    metrics_record,
    staging_path,
)
from jagg_pipeline.io.manifest import recorded_digests
from jagg_pipeline.stages import distributed

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

STAGE = "train"
TRAINER_DIR = "trainer"
STATE_FILE = "state.json"
OPTIMIZER_DIR = "optimizer"
RNG_FILE = "rng.safetensors"
EMA_DIR = "ema"


class NonFiniteError(RuntimeError):
    """Training produced non-finite weights or optimizer state; no checkpoint is written."""


@dataclass
class TrainerState:
    """What the next round needs besides weights and tensors (``trainer/state.json``)."""

    round: int
    global_step: int
    skipped_steps: int
    scheduler: dict[str, Any]
    routing: dict[str, Any] | None = None
    world_size: int = 1


@dataclass
class CheckpointContents:
    """Everything a checkpoint holds, as this rank holds it.

    ``model_state``, ``optimizer_state`` and ``ema_state`` are sharded state dicts (DTensors,
    or plain tensors in a world of one) keyed by parameter name; the rest is rank 0's.
    """

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: torch.Tensor
    trainer: TrainerState
    metrics: list[dict[str, Any]] = field(default_factory=list)
    ema_state: dict[str, torch.Tensor] | None = None


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _non_finite(contents: CheckpointContents) -> list[str]:
    """Names of this rank's weights, EMA weights and optimizer values that are not finite."""
    groups = {
        "weight": contents.model_state,
        "EMA weight": contents.ema_state or {},
        "optimizer value": {
            f"{p}/{n}": v
            for p, values in contents.optimizer_state["state"].items()
            for n, v in values.items()
            if isinstance(v, torch.Tensor)
        },
    }
    return [
        f"{what} {name}"
        for what, tensors in groups.items()
        for name, tensor in tensors.items()
        if tensor.is_floating_point() and not shards.local_tensor(tensor).isfinite().all()
    ]


def write_checkpoint(
    target: str | Path,
    contents: CheckpointContents,
    *,
    config: RunConfig,
    seeds: Mapping[str, Any],
    inputs: Mapping[str, str | Path],
    extra: Mapping[str, Any],
) -> Path:
    """Write the checkpoint directory ``target`` (see the module docstring); a collective.

    Every rank calls it with its own shards. Raises :class:`NonFiniteError` on every rank,
    writing nothing, if any rank holds a non-finite tensor. An existing ``target`` is replaced
    when the new one is complete. Needs a process group (a world of one will do).
    """
    target = Path(target)
    bad = [name for names in distributed.all_gather_object(_non_finite(contents)) for name in names]
    if bad:
        raise NonFiniteError(
            f"non-finite values after training (e.g. {bad[:3]}); no checkpoint written "
            "(lower train.lr or check the rewards)"
        )
    # A failure on one rank ends the job (torchrun stops the others), so no rank waits forever.
    main = distributed.is_main()
    with atomic_directory(target) if main else nullcontext(staging_path(target)) as staging:
        distributed.barrier()  # rank 0 has made the staging folder
        _write_shards(staging, contents)
        # Every rank's shard digests, recorded as it wrote them: rank 0 reads no shard back.
        recorded = {
            name: found
            for digests in distributed.all_gather_object(recorded_digests(staging))
            for name, found in digests.items()
        }
        if main:
            _write_main_files(staging, contents, config, seeds, inputs, extra, recorded)
    distributed.barrier()  # in place before any rank goes on
    return target


def _write_shards(staging: Path, contents: CheckpointContents) -> None:
    from jagg_pipeline.io.artifacts import policy_weights_dir

    shards.save(contents.model_state, policy_weights_dir(staging))
    shards.save(contents.optimizer_state, staging / TRAINER_DIR / OPTIMIZER_DIR)
    if contents.ema_state is not None:
        shards.save(contents.ema_state, staging / TRAINER_DIR / EMA_DIR)


def _write_main_files(
    staging: Path,
    contents: CheckpointContents,
    config: RunConfig,
    seeds: Mapping[str, Any],
    inputs: Mapping[str, str | Path],
    extra: Mapping[str, Any],
    recorded: Mapping[str, str],
) -> None:
    """Rank 0's part: trainer state, generator, metrics, config and manifest (last).

    ``recorded``: the digests of the shards every rank wrote, by name in ``staging``.
    """
    from jagg_pipeline.io.manifest import finish_output

    trainer = staging / TRAINER_DIR
    state = _json_safe(dataclasses.asdict(contents.trainer))
    atomic_write_text(trainer / STATE_FILE, json.dumps(state, indent=2) + "\n")
    rng = {"trainer": contents.rng_state.cpu().contiguous()}
    atomic_write_safetensors(trainer / RNG_FILE, rng)
    records = metrics_records(contents.metrics)
    atomic_write_text(staging / METRICS_NAME, "".join(json.dumps(r) + "\n" for r in records))
    # config.yaml, then the manifest: the last file, the mark of a finished checkpoint.
    finish_output(
        staging, config, stage=STAGE, seeds=seeds, inputs=inputs, extra=extra, recorded=recorded
    )


def metrics_records(metrics: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A round's metric lines (``CKPT/metrics.jsonl``): one flat record per optimizer step."""
    return [metrics_record(STAGE, row["round"], row["step"], _step_values(row)) for row in metrics]


def _step_values(row: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key not in ("round", "step")}


def _json_safe(value: Any) -> Any:
    """NaN and infinities as None (strict JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _trainer_path(checkpoint: str | Path, name: str) -> Path:
    path = Path(checkpoint) / TRAINER_DIR / name
    if not path.exists():
        raise FileNotFoundError(
            f"{path} missing: {checkpoint} is not a complete training checkpoint"
        )
    return path


def read_trainer_state(checkpoint: str | Path) -> TrainerState:
    """``trainer/state.json`` of a checkpoint."""
    path = _trainer_path(checkpoint, STATE_FILE)
    return TrainerState(**json.loads(path.read_text()))


def read_optimizer_state(checkpoint: str | Path) -> dict[str, Any]:
    """The whole optimizer state dict (parameter names as keys), read in this one process."""
    return shards.read(_trainer_path(checkpoint, OPTIMIZER_DIR))


def read_rng_state(checkpoint: str | Path) -> torch.Tensor:
    """The trainer generator's state saved in a checkpoint."""
    from safetensors.torch import load_file

    return load_file(str(_trainer_path(checkpoint, RNG_FILE)))["trainer"]


def optimizer_dir(checkpoint: str | Path) -> Path:
    """The sharded optimizer state of a checkpoint."""
    return _trainer_path(checkpoint, OPTIMIZER_DIR)


def ema_dir(checkpoint: str | Path) -> Path | None:
    """The sharded EMA weights of a checkpoint, or None if it was trained without EMA."""
    path = Path(checkpoint) / TRAINER_DIR / EMA_DIR
    return path if path.is_dir() else None


def read_ema_state(checkpoint: str | Path) -> dict[str, torch.Tensor] | None:
    """The whole EMA weights of a checkpoint (this one process), or None without EMA."""
    path = ema_dir(checkpoint)
    return None if path is None else shards.read(path)
